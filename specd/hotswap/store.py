"""The weight store: numbered, immutable drafter versions with manifests, and which one is live.

Contract: a store is a directory:
    versions/000001/drafter.safetensors   weights (never rewritten once published)
    versions/000001/manifest.json         parent, sha256, created, drafter config, target
                                          fingerprint, records/tokens trained, evaluation, status
    live.json                             {"version": n, "history": [earlier live versions],
                                           "rollbacks": how many rollbacks ever}
Every write goes to a temporary file in the same directory and is renamed into place, so a crash
leaves either the old file or the new one, never half of one; a version directory appears only
once complete. Status is one of candidate / live / retired / rejected / rolled-back; `pinned` is a
separate flag: pinned versions are never garbage-collected, and the canary never rolls back a pinned
live version (an operator still may).
Changes of the live version (`set_live`, `rollback`) and `gc` hold an exclusive lock on
`live.lock`, so a learner, an operator's CLI and the canary in other processes (or threads) never
interleave them; `set_live(..., if_live=n)` and `rollback(..., if_live=n)` act only while n is still
live (a compare-and-set): a decision taken before someone else's change cannot overwrite it.
Manifest updates (read, change, write) hold `manifest.lock`, so concurrent updates of different
fields of one manifest never lose one another; the lock order is live.lock, then manifest.lock.
`publish` holds `publish.lock`, so publishers in other threads or processes never take one number.
`gc` never collects the live version, a pinned one, one of the newest `keep_last`, one of the last
`keep_last` in the live history (rollback's default choices), one of the `keep_last` versions live
most recently by their manifests (a rollback cuts the history short), or one that was live within
the last `keep_live_within_s` seconds (servers may still be loading or serving it); a collected version
disappears in one rename, and rollback chooses only versions whose weights are present.
A version goes live (promotion or rollback) only if its weights still match the manifest's sha256
and pass the caller's own `check` of the file, where given (run under the lock).
A store file that cannot be read as what it must be (live.json, a manifest: not JSON, not an
object, live.json's fields of the wrong type) raises `StoreCorrupt` naming the file; nothing
rewrites or deletes such a file (it is the evidence): gc keeps a version whose manifest is corrupt,
and a version leaving live whose manifest is corrupt is left unmarked. A server follows this by
refusing a version whose manifest is corrupt and keeping the one it serves (see the swapper).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from specd.core.errors import StoreError, VersionNotFound, out_of_space
from specd.core.files import write_text_atomic
from specd.drafter.checkpoint import DrafterModel, save_drafter
from specd.hotswap.integrity import check_file, sha256_file
from specd.model.fingerprint import TargetFingerprint

log = logging.getLogger(__name__)
MAX_VERSION = 10**18   # version numbers are below this (a client's larger number names no version)

STATUSES = ("candidate", "live", "retired", "rejected", "rolled-back")


class LiveVersionChanged(StoreError):
    """A conditional promotion found another version live than the one it was decided against."""


class StoreCorrupt(StoreError):
    """A store file (live.json, a manifest) that is not what it must be; the message names the file."""


class _AnyLive:
    """`set_live`'s default condition: promote whatever is live now."""


ANY_LIVE = _AnyLive()


def _write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2), fsync=True)  # a failed write leaves no temporary file


def _read_json(path: Path) -> Any:
    """The JSON in `path`; StoreCorrupt when it is not JSON (truncated, overwritten, not text)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except OSError as error:  # no permission, a folder in the file's place
        raise StoreError(f"{path} cannot be read ({error.strerror or error})") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
        raise StoreCorrupt(f"{path} is not valid JSON ({error}): the store is damaged; "
                           f"restore the file or move it away") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_live_state(path: Path, state: Any) -> dict[str, Any]:
    """live.json's content, checked: every reader indexes it as {"version": int|None, "history": [int]}."""
    if not isinstance(state, dict):
        raise StoreCorrupt(f"{path} holds a JSON {type(state).__name__}, not an object with the live version")
    version, history = state.get("version"), state.get("history", [])
    if version is not None and not _is_int(version):
        raise StoreCorrupt(f"{path}: 'version' is {version!r}, not a version number or null")
    if not isinstance(history, list) or not all(_is_int(v) for v in history):
        raise StoreCorrupt(f"{path}: 'history' is {history!r}, not a list of version numbers")
    if not _is_int(state.get("rollbacks", 0)):
        raise StoreCorrupt(f"{path}: 'rollbacks' is {state['rollbacks']!r}, not a count")
    return {**state, "version": version, "history": history}


def _last_live(manifest: dict[str, Any]) -> float | None:
    """When a version was last live, as far as its manifest says (None: never; gc keeps the live one anyway)."""
    times = [t for t in (manifest.get("live_until"), manifest.get("live_since")) if isinstance(t, (int, float))]
    return max(times, default=None)


class WeightStore:
    def __init__(self, root: str | Path, keep_last: int = 5, keep_live_within_s: float = 300.0) -> None:
        if keep_last < 1 or keep_live_within_s < 0:
            raise StoreError(f"keep_last must be at least 1 and keep_live_within_s at least 0, "
                             f"got {keep_last} and {keep_live_within_s}")
        self.root = Path(root)
        self.keep_last = keep_last
        # five minutes: longer than servers take to fetch, check and swap to a new version, so the
        # one they still serve (and may roll back to) is never deleted under them
        self.keep_live_within_s = keep_live_within_s
        try:
            (self.root / "versions").mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a regular file in the way, no permission, a read-only disk
            raise StoreError(f"{self.root}: cannot be a weight store folder ({error.strerror or error})") from None

    # ---- reading --------------------------------------------------------------------------
    def version_dir(self, version: int) -> Path:
        if not 0 <= version < MAX_VERSION:  # a number no store holds, however a client spelt it
            shown = str(version)[:24] + ("… (no store numbers a version that high)" if len(str(version)) > 24 else "")
            raise VersionNotFound(f"version {shown} does not exist in {self.root}")
        return self.root / "versions" / f"{version:06d}"

    def weights_path(self, version: int) -> Path:
        return self.version_dir(version) / "drafter.safetensors"

    def versions(self) -> list[int]:
        return sorted(int(p.name) for p in (self.root / "versions").iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file())

    def _loadable(self) -> set[int]:
        """Versions whose manifest and weights are both present: the only ones made live again."""
        return {v for v in self.versions() if self.weights_path(v).is_file()}

    def manifest(self, version: int) -> dict[str, Any]:
        path = self.version_dir(version) / "manifest.json"
        if not path.is_file():
            raise VersionNotFound(f"version {version} does not exist in {self.root}")
        try:
            manifest = _read_json(path)
        except FileNotFoundError:  # collected a moment ago
            raise VersionNotFound(f"version {version} does not exist in {self.root}") from None
        if not isinstance(manifest, dict):
            raise StoreCorrupt(f"{path} holds a JSON {type(manifest).__name__}, not a manifest object")
        return manifest

    def manifests(self) -> list[dict[str, Any]]:
        """Every version's manifest with its version number, for listings: one that cannot be read is a
        stand-in `{"version", "status": "unreadable", "error"}`, so that the others still list."""
        listing = []
        for version in self.versions():
            try:
                # the folder's number is the version's (a folder copied in by hand keeps its old manifest)
                listing.append({**self.manifest(version), "version": version})
            except StoreError as error:  # damaged (or collected a moment ago)
                listing.append({"version": version, "status": "unreadable", "error": str(error)})
        return listing

    def live_state(self) -> dict[str, Any]:
        path = self.root / "live.json"
        if not path.is_file():
            return {"version": None, "history": []}
        return _checked_live_state(path, _read_json(path))

    def live_version(self) -> int | None:
        version = self.live_state()["version"]
        return None if version is None else int(version)

    # ---- writing --------------------------------------------------------------------------
    def publish(self, model: DrafterModel, fingerprint: TargetFingerprint, parent: int | None,
                info: dict[str, Any], target_embedding: torch.Tensor | None = None) -> int:
        """Write a new candidate version; returns its number (chosen under `publish.lock`)."""
        with self._lock("publish.lock"):
            version = max(self.versions(), default=0) + 1
            staging = Path(tempfile.mkdtemp(dir=self.root / "versions", prefix=".staging."))
            try:
                weights = staging / "drafter.safetensors"
                save_drafter(model, weights, fingerprint, {"version": str(version)}, target_embedding)
                manifest = {"version": version, "parent": parent, "sha256": sha256_file(weights),
                            "created": time.time(), "drafter_config": json.loads(json.dumps(model.config.__dict__)),
                            "target_fingerprint": fingerprint.__dict__, "status": "candidate", "pinned": False,
                            "history": [], **info}
                _write_json_atomic(staging / "manifest.json", manifest)
                os.rename(staging, self.version_dir(version))
            except Exception as error:
                if out_of_space(error):  # say which store is full (safetensors' own error names no file)
                    raise StoreError(f"cannot write version {version} to the store {self.root}: no space left on "
                                     f"its device") from error
                raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return version

    def update(self, version: int, **fields: Any) -> dict[str, Any]:
        """Change fields of a manifest; concurrent updates (threads or processes) are serialised."""
        if "status" in fields and fields["status"] not in STATUSES:
            raise StoreError(f"unknown status {fields['status']!r}")
        with self._lock("manifest.lock"):
            manifest = self.manifest(version)
            manifest.update(fields)
            _write_json_atomic(self.version_dir(version) / "manifest.json", manifest)
        return manifest

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """An exclusive store-wide lock. Each acquisition opens the file itself: flock locks belong to
        an open file, so this excludes other threads of this process as well as other processes."""
        with (self.root / name).open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _live_lock(self) -> contextlib.AbstractContextManager[None]:
        return self._lock("live.lock")

    def set_live(self, version: int, reason: str = "promoted", if_live: int | _AnyLive | None = ANY_LIVE,
                 check: Callable[[int], None] | None = None) -> None:
        """Make `version` live; with `if_live`, only while that version is still the live one; with
        `check`, only if `check(version)` raises nothing, run under the live lock (what the caller can
        check of the file beyond its digest: between a check and the change no one else acts)."""
        with self._live_lock():
            self._set_live_locked(version, reason, if_live, check)

    def _set_live_locked(self, version: int, reason: str, if_live: int | _AnyLive | None,
                         check: Callable[[int], None] | None) -> None:
        state = self.live_state()
        previous = state["version"]
        if not isinstance(if_live, _AnyLive) and previous != if_live:
            raise LiveVersionChanged(f"version {previous} is live now, not {if_live}: {version} is not promoted")
        manifest = self.manifest(version)
        if manifest.get("status") == "rejected":
            raise StoreError(f"version {version} was rejected by the gate: {manifest.get('reason')}")
        if version not in self._loadable():
            raise VersionNotFound(f"version {version} has no weights in {self.root}")
        if previous == version:
            return
        self.check_weights(version, manifest)
        if check is not None:
            check(version)
        now = time.time()
        if previous is not None:
            self._leave_live(previous, now, status="retired")
            state["history"].append(previous)
        self.update(version, status="live", live_since=now, live_reason=reason)
        _write_json_atomic(self.root / "live.json", {**state, "version": version, "history": state["history"][-100:]})

    def check_weights(self, version: int, manifest: dict[str, Any] | None = None) -> None:
        """Refuse to make live weights that no longer match their manifest (a disk fault, a bad copy):
        every server would refuse them and keep serving the old version while the store said otherwise."""
        manifest = manifest if manifest is not None else self.manifest(version)
        check_file(version, self.weights_path(version), manifest, StoreError)

    def _leave_live(self, version: int, now: float, **fields: Any) -> None:
        """Mark the version that stops being live; `live_until` keeps it from gc for a while."""
        try:
            self.update(version, live_until=now, **fields)
        except VersionNotFound:  # deleted by hand: nothing to mark
            pass
        except StoreCorrupt as error:  # left as found: a damaged live version must not block its successor
            log.warning("version %s leaves live unmarked: %s", version, error)

    def rollback(self, to: int | None = None, evidence: dict[str, Any] | None = None,
                 if_live: int | _AnyLive | None = ANY_LIVE, unless_pinned: bool = False,
                 check: Callable[[int], None] | None = None) -> int:
        """Make `to` (default: the previous live version) live again; the current one is rolled back.
        With `if_live`, only while that version is still the live one (LiveVersionChanged otherwise);
        with `unless_pinned`, only while it is not pinned (read under the lock: the canary's rule);
        with `check`, as `set_live`."""
        with self._live_lock():
            return self._rollback_locked(to, evidence, if_live, unless_pinned, check)

    def _rollback_locked(self, to: int | None, evidence: dict[str, Any] | None, if_live: int | _AnyLive | None,
                         unless_pinned: bool, check: Callable[[int], None] | None) -> int:
        state = self.live_state()
        current = state["version"]
        if not isinstance(if_live, _AnyLive) and current != if_live:
            raise LiveVersionChanged(f"version {current} is live now, not {if_live}: nothing is rolled back")
        if unless_pinned and current is not None and self.manifest(current).get("pinned"):
            raise LiveVersionChanged(f"version {current} was pinned meanwhile: nothing is rolled back")
        if current is None:
            raise StoreError("nothing is live: there is nothing to roll back")
        earlier, history = self._history_to_roll_back_to(state)
        if to is None:
            if not history:
                raise StoreError(_nothing_to_roll_back_to(current, earlier, self.root))
            to = history[-1]
        if to not in history and to not in self._loadable():
            raise VersionNotFound(self._missing_files(to))
        if to == current:
            raise StoreError(f"version {to} is already live")
        manifest = self.manifest(to)
        if manifest.get("status") in ("candidate", "rejected"):  # never live: a rollback must not skip the gate
            raise StoreError(f"version {to} has never been live (it is {manifest.get('status')}): a rollback "
                             f"returns to a version that served; a candidate goes live through the gate "
                             f"(POST /v1/live)")
        self.check_weights(to, manifest)
        if check is not None:
            check(to)
        now = time.time()
        # timed, so that the dashboard marks an operator's rollback as it marks the canary's
        self._leave_live(current, now, status="rolled-back",
                         rollback_evidence={"time": now, **(evidence or {"by": "operator"})})
        self.update(to, status="live", live_since=now, live_reason=f"rollback from {current}")
        remaining = history[:history.index(to)] if to in history else history
        _write_json_atomic(self.root / "live.json", {"version": to, "history": remaining,
                                                     "rollbacks": int(state.get("rollbacks", 0)) + 1})
        return to

    def operator_rollback(self, to: int | None, if_live: int | None, check: Callable[[int], None]) -> int:
        """An operator's rollback to `to` (default: the previous live version) while `if_live` is
        live, if `check(to)` (what the caller can check of the file beyond its digest) passes."""
        return self.rollback(to, {"by": "operator"}, if_live=if_live, check=check)

    def _history_to_roll_back_to(self, state: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(earlier live versions, those of them whose files are present: never a version whose files are gone)."""
        loadable = self._loadable()
        earlier = [v for v in state["history"] if v != state["version"]]
        return earlier, [v for v in earlier if v in loadable]

    def _missing_files(self, version: int) -> str:
        if version in self.versions():
            return f"version {version}'s weights are missing from {self.version_dir(version)}"
        return f"version {version} does not exist in {self.root}"

    def pin(self, version: int, pinned: bool = True) -> None:
        # the time makes the (un)pinning an event the dashboard can mark, as swaps and rollbacks are
        self.update(version, pinned=pinned, pin_time=time.time())

    def gc(self) -> list[int]:
        """Delete the versions nobody may need (see the module's contract); returns their numbers."""
        # under the live lock: a rollback (or promotion) never chooses a version gc is deleting,
        # and every version made live before gc looks is seen live
        with self._live_lock():
            state = self.live_state()
            versions = self.versions()
            keep = (set(versions[-self.keep_last:]) | set(state["history"][-self.keep_last:]) | {state["version"]}
                    | self._last_served(versions))
            cutoff = time.time() - self.keep_live_within_s
            removed = []
            for version in versions:
                if version in keep:
                    continue
                with self._lock("manifest.lock"):  # a concurrent pin lands before this look, or finds it gone
                    try:
                        manifest = self.manifest(version)
                    except VersionNotFound:  # deleted by hand meanwhile
                        continue
                    except StoreCorrupt as error:  # unknown whether pinned or recently live: keep it
                        log.warning("gc keeps version %s: %s", version, error)
                        continue
                    last_live = _last_live(manifest)
                    if manifest.get("pinned") or (last_live is not None and last_live >= cutoff):
                        continue
                    self._delete(version)
                removed.append(version)
            return removed

    def _last_served(self, versions: list[int]) -> set[int]:
        """The `keep_last` versions live most recently, by their manifests: a rollback to one cuts the
        history short, and the versions it cut (retired, rolled back) still served and may be wanted."""
        served = []
        for version in versions:
            with contextlib.suppress(StoreError):  # unreadable or gone: gc's own pass decides
                last_live = _last_live(self.manifest(version))
                if last_live is not None:
                    served.append((last_live, version))
        return {version for _, version in sorted(served)[-self.keep_last:]}

    def _delete(self, version: int) -> None:
        # one rename takes the whole version out of `versions()`; a crash mid-delete leaves only trash
        trash = self.root / "versions" / f".deleting.{version:06d}.{uuid.uuid4().hex[:8]}"
        os.rename(self.version_dir(version), trash)
        shutil.rmtree(trash, ignore_errors=True)


def _nothing_to_roll_back_to(current: int, earlier: list[int], root: Path) -> str:
    """Why a rollback without a version has no choice: no earlier live version, or none with its files."""
    if not earlier:
        return (f"version {current} has no earlier live version to roll back to (versions rolled back from are "
                f"not returned to by default): name the version to make live")
    named = ", ".join(str(v) for v in reversed(earlier[-5:]))
    return (f"version {current}'s earlier live versions ({named}) have their files missing from {root}/versions: "
            f"nothing to roll back to; name a version that is there")
