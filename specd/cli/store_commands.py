"""`specd versions`, `rollback`, `pin`, `status`: the weight store, locally or over a control plane's HTTP.

Contract: each command reads or changes the store (a folder, `--store`) or asks a learner's control
plane (`--url`); what cannot be done is a `SpecdError` (the CLI's one-line error): a folder that is
no store, a damaged store file (named), a URL that is not http(s), an answer that is not the JSON
object asked for. `versions` lists what it can: a manifest it cannot read is a row saying so, a
missing field a `-`, and a live pointer naming a version the store lacks is said on the `live:` line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from specd.core.errors import (
    CheckpointError,
    ConfigurationError,
    SpecdError,
    StoreError,
    TransportError,
    VersionNotFound,
)
from specd.hotswap.integrity import check_contents_of
from specd.hotswap.store import WeightStore


def _where(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="weight store directory")
    where.add_argument("--url", help="a running learner (or embedded server), e.g. http://127.0.0.1:8100")
    p.add_argument("--token", default=None, help="bearer token for control operations (or $SPECD_TOKEN)")


def add_store_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("versions", help="list drafter versions")
    _where(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (live version, manifests, served acceptance) instead of the table")
    p.set_defaults(run=run_versions)
    p = sub.add_parser("rollback", help="make another version live: by default the one live before the current")
    p.add_argument("version", nargs="?", type=int,
                   help="version to make live, earlier or later than the live one "
                        "(default: the last earlier live version whose files are present)")
    _where(p)
    p.set_defaults(run=run_rollback)
    p = sub.add_parser("pin", help="keep a version forever, as a floor to fall back to")
    p.add_argument("version", type=int, help="version to pin (or, with --unpin, to unpin)")
    _where(p)
    p.add_argument("--unpin", action="store_true",
                   help="remove the pin instead: the version may then be garbage-collected")
    p.set_defaults(run=run_pin)
    p = sub.add_parser("status", help="live version, learner and store status")
    _where(p)
    p.set_defaults(run=run_status)


def _open_store(path: str) -> WeightStore:
    if not Path(path, "versions").is_dir():
        raise StoreError(f"{path}: not a specd weight store (no versions/ folder)")
    return WeightStore(path)


def _http(args: argparse.Namespace, path: str, body: dict | None = None) -> dict:
    """GET (or POST with a JSON body) against a learner's control plane; its answer, a JSON object.

    A URL that is not http(s)://host is a ConfigurationError. An error answer becomes the SpecdError
    of its status (404: VersionNotFound, other 4xx: StoreError, 401: ConfigurationError, a missing
    token); no answer at all, or one that is not a JSON object, is a TransportError.
    """
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    url = args.url.rstrip("/") + path
    try:
        parts = urllib.parse.urlsplit(args.url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number, a malformed IPv6 host
        usable = False
    if not usable:
        raise ConfigurationError(f"--url {args.url!r} is not an http(s)://host[:port] URL, e.g. http://127.0.0.1:8100")
    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get("SPECD_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    try:
        request = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        kind: type[SpecdError] = {401: ConfigurationError, 404: VersionNotFound}.get(error.code, StoreError)
        if error.code >= 500:
            kind = TransportError
        raise kind(f"{url}: {error.code} {message}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        raise TransportError(f"{args.url}: unreachable ({error})") from None
    except ValueError as error:  # a URL urllib still cannot use
        raise ConfigurationError(f"--url {args.url!r} is not a usable URL ({error})") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        raise TransportError(f"{url} answered something that is not JSON: {raw[:60]!r}") from None
    if not isinstance(answer, dict):
        raise TransportError(f"{url} answered a JSON {type(answer).__name__}, not an object")
    return answer


def _field(answer: dict, key: str, kind: type | tuple[type, ...], url: str) -> Any:
    """answer[key], checked to be of `kind`: a control plane's answer as specd's own learner gives it."""
    value = answer.get(key)
    if not isinstance(value, kind):
        raise TransportError(f"{url}: the answer's {key!r} is {value!r}, not what a specd learner sends")
    return value


def run_status(args: argparse.Namespace) -> int:
    if args.url:
        print(json.dumps(_http(args, "/v1/status"), indent=2))
        return 0
    store = _open_store(args.store)
    state = store.live_state()
    print(json.dumps({"live": state["version"], "versions": len(store.versions()),
                      "history": state["history"]}, indent=2))
    return 0


def _listing(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(live, manifests, acceptance by version, acceptance by source), from the store or a control plane."""
    if not args.url:
        store = _open_store(args.store)
        return store.live_version(), store.manifests(), {}, {}
    url = args.url.rstrip("/")
    listing = _http(args, "/v1/versions")
    manifests = _field(listing, "versions", list, url + "/v1/versions")
    if not all(isinstance(m, dict) for m in manifests):
        raise TransportError(f"{url}/v1/versions: the answer's 'versions' are not all manifest objects")
    served = _http(args, "/v1/acceptance")  # what the servers report, per version and per source
    by_version = served.get("totals") or {}
    by_source = served.get("source_totals") or {}
    if not isinstance(by_version, dict) or not isinstance(by_source, dict):
        raise TransportError(f"{url}/v1/acceptance: 'totals' and 'source_totals' are not objects")
    return listing.get("live"), manifests, by_version, by_source


def run_versions(args: argparse.Namespace) -> int:
    live, manifests, by_version, by_source = _listing(args)
    missing = live is not None and live not in {m.get("version") for m in manifests}
    if args.json:
        print(json.dumps({"live": live, "live_missing": missing, "versions": manifests,
                          "served_by_version": by_version, "served_by_source": by_source}))
        return 0
    # a live pointer to a version that is gone: the statuses below (a "live" among them) are stale
    print(f"live: {live}" + ("  (missing: the live pointer names a version the store does not hold)"
                             if missing else ""))
    print(f"{'version':>7}  {'status':11} {'pinned':6} {'parent':>6}  {'accept len (cand/live)':22} "
          f"{'served acceptance':17} created")
    for m in manifests:
        print(_row(m, by_version))
    if manifests:
        print("accept len: the gate's replay of each version's learned drafter alone on the learner's held-out "
              "records, at a fixed number of drafts a step; served acceptance: drafts accepted / drafted as servers "
              "reported them (every source's own steps), so the two need not agree")
    if by_source:
        print("served acceptance by drafting source: " + ", ".join(
            f"{source} {_acceptance(counts)}" for source, counts in sorted(by_source.items()) if source != "none"))
    return 0


def _score(value: Any) -> str:
    """A gate figure as the table shows it: three decimals (a replay's float fits the column)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.3f}"


def _row(m: dict[str, Any], by_version: dict[str, Any]) -> str:
    """One table row; a field a manifest lacks (an old or hand-edited one) shows as `-`."""
    if m.get("status") == "unreadable":
        return f"{m.get('version', '?'):>7}  unreadable: {m.get('error')}"
    evaluation = m.get("evaluation")
    evaluation = evaluation if isinstance(evaluation, dict) else {}
    scores = f"{_score(evaluation.get('candidate'))}/{_score(evaluation.get('live'))}"
    created = m.get("created")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
            if isinstance(created, (int, float)) and not isinstance(created, bool) else "-")
    version = m.get("version", "?")
    counts = by_version.get(str(version))
    served = _acceptance(counts if isinstance(counts, dict) else None)
    return (f"{version!s:>7}  {m.get('status') or '-'!s:11} {'yes' if m.get('pinned') else '':6} "
            f"{m.get('parent') or '-'!s:>6}  {scores:22} {served:17} {when}")


def _acceptance(counts: dict[str, int] | None) -> str:
    """"accepted/drafts = rate" of reported counts, or "-" when nothing was drafted."""
    if not counts or not counts.get("drafts"):
        return "-"
    return f"{counts['accepted']}/{counts['drafts']} = {counts['accepted'] / counts['drafts']:.2f}"


def run_rollback(args: argparse.Namespace) -> int:
    if args.url:
        answer = _http(args, "/v1/rollback", {"version": args.version})
        restored = _field(answer, "live", int, args.url.rstrip("/") + "/v1/rollback")
    else:
        store = _open_store(args.store)

        live = store.live_version()
        # the live version's file is what servers load now (unless they refuse it: then --url)
        like = store.weights_path(live) if live is not None and store.weights_path(live).is_file() else None

        def check(version: int) -> None:  # what needs no target; the plane (--url) checks it all
            try:
                check_contents_of(version, store.weights_path(version), store.manifest(version), like)
            except CheckpointError as error:
                hint = (f" (if servers refuse version {live}, `specd rollback --url` checks version {version} "
                        f"against their own target)" if like is not None else "")
                raise StoreError(f"version {version} cannot go live: {error}{hint}") from None

        # against the version live as it reads: a rollback at once elsewhere wins
        restored = store.operator_rollback(args.version, live, check)
    print(f"version {restored} is live")
    return 0


def run_pin(args: argparse.Namespace) -> int:
    version, pinned = args.version, not args.unpin
    if args.url:
        answer = _http(args, "/v1/pin", {"version": args.version, "pinned": not args.unpin})
        where = args.url.rstrip("/") + "/v1/pin"  # what the server did, not what was asked
        version, pinned = _field(answer, "version", int, where), _field(answer, "pinned", bool, where)
    else:
        _open_store(args.store).pin(args.version, not args.unpin)
    print(f"version {version} {'pinned' if pinned else 'unpinned'}")
    return 0
