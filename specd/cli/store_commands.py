"""`specd versions`, `rollback`, `pin`, `status`: the weight store, locally or over a control plane's HTTP."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from specd.core.errors import ConfigurationError, SpecdError, StoreError, TransportError, VersionNotFound
from specd.hotswap.store import WeightStore


def _where(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="weight store directory")
    where.add_argument("--url", help="a running learner (or embedded server), e.g. http://127.0.0.1:8100")
    p.add_argument("--token", default=None, help="bearer token for control operations (or $SPECD_TOKEN)")


def add_store_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("versions", help="list drafter versions")
    _where(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_versions)
    p = sub.add_parser("rollback", help="make an earlier version live again")
    p.add_argument("version", nargs="?", type=int, help="version to restore (default: the previous live one)")
    _where(p)
    p.set_defaults(run=run_rollback)
    p = sub.add_parser("pin", help="keep a version forever, as a floor to fall back to")
    p.add_argument("version", type=int)
    _where(p)
    p.add_argument("--unpin", action="store_true")
    p.set_defaults(run=run_pin)
    p = sub.add_parser("status", help="live version, learner and store status")
    _where(p)
    p.set_defaults(run=run_status)


def _open_store(path: str) -> WeightStore:
    if not Path(path, "versions").is_dir():
        raise StoreError(f"{path}: not a specd weight store (no versions/ folder)")
    return WeightStore(path)


def _http(args: argparse.Namespace, path: str, body: dict | None = None) -> dict:
    """GET (or POST with a JSON body) against a learner's control plane.

    An error answer becomes the SpecdError of its status (404: VersionNotFound, other 4xx: StoreError,
    401: ConfigurationError, a missing token); no answer at all is a TransportError.
    """
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get("SPECD_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        kind: type[SpecdError] = {401: ConfigurationError, 404: VersionNotFound}.get(error.code, StoreError)
        if error.code >= 500:
            kind = TransportError
        raise kind(f"{args.url}{path}: {error.code} {message}") from None
    except (urllib.error.URLError, OSError) as error:
        raise TransportError(f"{args.url}: unreachable ({error})") from None


def run_status(args: argparse.Namespace) -> int:
    if args.url:
        print(json.dumps(_http(args, "/v1/status"), indent=2))
        return 0
    store = _open_store(args.store)
    print(json.dumps({"live": store.live_version(), "versions": len(store.versions()),
                      "history": store.live_state()["history"]}, indent=2))
    return 0


def run_versions(args: argparse.Namespace) -> int:
    served: dict[str, dict[str, dict[str, int]]] = {"totals": {}, "source_totals": {}}
    if args.url:
        listing = _http(args, "/v1/versions")
        live, manifests = listing["live"], listing["versions"]
        served = _http(args, "/v1/acceptance")  # what the servers report, per version and per source
    else:
        store = _open_store(args.store)
        live, manifests = store.live_version(), [store.manifest(v) for v in store.versions()]
    by_version, by_source = served.get("totals", {}), served.get("source_totals", {})
    if args.json:
        print(json.dumps({"live": live, "versions": manifests, "served_by_version": by_version,
                          "served_by_source": by_source}))
        return 0
    print(f"live: {live}")
    print(f"{'version':>7}  {'status':11} {'pinned':6} {'parent':>6}  {'accept len (cand/live)':22} "
          f"{'served acceptance':17} created")
    for m in manifests:
        evaluation = m.get("evaluation") or {}
        scores = f"{evaluation.get('candidate') or '-'}/{evaluation.get('live') or '-'}"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["created"]))
        print(f"{m['version']:>7}  {m['status']:11} {'yes' if m.get('pinned') else '':6} "
              f"{m.get('parent') or '-':>6}  {scores:22} {_acceptance(by_version.get(str(m['version']))):17} {created}")
    if by_source:
        print("served acceptance by drafting source: " + ", ".join(
            f"{source} {_acceptance(counts)}" for source, counts in sorted(by_source.items()) if source != "none"))
    return 0


def _acceptance(counts: dict[str, int] | None) -> str:
    """"accepted/drafts = rate" of reported counts, or "-" when nothing was drafted."""
    if not counts or not counts.get("drafts"):
        return "-"
    return f"{counts['accepted']}/{counts['drafts']} = {counts['accepted'] / counts['drafts']:.2f}"


def run_rollback(args: argparse.Namespace) -> int:
    if args.url:
        restored = _http(args, "/v1/rollback", {"version": args.version})["live"]
    else:
        restored = _open_store(args.store).rollback(args.version, {"by": "operator"})
    print(f"version {restored} is live")
    return 0


def run_pin(args: argparse.Namespace) -> int:
    if args.url:
        _http(args, "/v1/pin", {"version": args.version, "pinned": not args.unpin})
    else:
        _open_store(args.store).pin(args.version, not args.unpin)
    print(f"version {args.version} {'unpinned' if args.unpin else 'pinned'}")
    return 0
