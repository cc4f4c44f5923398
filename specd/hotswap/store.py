"""The weight store: numbered, immutable drafter versions with manifests, and which one is live.

Contract: a store is a directory:
    versions/000001/drafter.safetensors   weights (never rewritten once published)
    versions/000001/manifest.json         parent, sha256, created, drafter config, target
                                          fingerprint, records/tokens trained, evaluation, status
    live.json                             {"version": n, "history": [earlier live versions]}
Every write goes to a temporary file in the same directory and is renamed into place, so a crash
leaves either the old file or the new one, never half of one; a version directory appears only
once complete. Status is one of candidate / live / retired / rejected / rolled-back; `pinned` is a
separate flag: pinned versions are never garbage-collected and act as the rollback floor.
Changes of the live version (`set_live`, `rollback`) hold an exclusive lock on `live.lock`, so a
learner, an operator's CLI and the canary in other processes never interleave them, and
`set_live(..., if_live=n)` promotes only while n is still live (a compare-and-set): a promotion
decided before someone else's rollback cannot overwrite it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specd.drafter.checkpoint import DrafterModel, save_drafter
from specd.errors import StoreError, VersionNotFound
from specd.model.fingerprint import TargetFingerprint

STATUSES = ("candidate", "live", "retired", "rejected", "rolled-back")


class LiveVersionChanged(StoreError):
    """A conditional promotion found another version live than the one it was decided against."""


class _AnyLive:
    """`set_live`'s default condition: promote whatever is live now."""


ANY_LIVE = _AnyLive()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class WeightStore:
    def __init__(self, root: str | Path, keep_last: int = 5) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        (self.root / "versions").mkdir(parents=True, exist_ok=True)

    # ---- reading --------------------------------------------------------------------------
    def version_dir(self, version: int) -> Path:
        return self.root / "versions" / f"{version:06d}"

    def weights_path(self, version: int) -> Path:
        return self.version_dir(version) / "drafter.safetensors"

    def versions(self) -> list[int]:
        return sorted(int(p.name) for p in (self.root / "versions").iterdir()
                      if p.name.isdigit() and (p / "manifest.json").is_file())

    def manifest(self, version: int) -> dict[str, Any]:
        path = self.version_dir(version) / "manifest.json"
        if not path.is_file():
            raise VersionNotFound(f"version {version} does not exist in {self.root}")
        return dict(json.loads(path.read_text()))

    def live_state(self) -> dict[str, Any]:
        path = self.root / "live.json"
        return json.loads(path.read_text()) if path.is_file() else {"version": None, "history": []}

    def live_version(self) -> int | None:
        version = self.live_state()["version"]
        return None if version is None else int(version)

    # ---- writing --------------------------------------------------------------------------
    def publish(self, model: DrafterModel, fingerprint: TargetFingerprint, parent: int | None,
                info: dict[str, Any], target_embedding: torch.Tensor | None = None) -> int:
        """Write a new candidate version; returns its number."""
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
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return version

    def update(self, version: int, **fields: Any) -> dict[str, Any]:
        manifest = self.manifest(version)
        if "status" in fields and fields["status"] not in STATUSES:
            raise StoreError(f"unknown status {fields['status']!r}")
        manifest.update(fields)
        _write_json_atomic(self.version_dir(version) / "manifest.json", manifest)
        return manifest

    @contextlib.contextmanager
    def _live_lock(self) -> Iterator[None]:
        with (self.root / "live.lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield

    def set_live(self, version: int, reason: str = "promoted", if_live: int | _AnyLive | None = ANY_LIVE) -> None:
        """Make `version` live; with `if_live`, only while that version is still the live one."""
        manifest = self.manifest(version)
        if manifest["status"] == "rejected":
            raise StoreError(f"version {version} was rejected by the gate: {manifest.get('reason')}")
        with self._live_lock():
            self._set_live_locked(version, reason, if_live)

    def _set_live_locked(self, version: int, reason: str, if_live: int | _AnyLive | None) -> None:
        state = self.live_state()
        previous = state["version"]
        if not isinstance(if_live, _AnyLive) and previous != if_live:
            raise LiveVersionChanged(f"version {previous} is live now, not {if_live}: {version} is not promoted")
        if previous == version:
            return
        if previous is not None:
            self.update(previous, status="retired")
            state["history"].append(previous)
        self.update(version, status="live", live_since=time.time(), live_reason=reason)
        _write_json_atomic(self.root / "live.json", {"version": version, "history": state["history"][-100:]})

    def rollback(self, to: int | None = None, evidence: dict[str, Any] | None = None) -> int:
        """Make `to` (default: the previous live version) live again; the current one is rolled back."""
        with self._live_lock():
            return self._rollback_locked(to, evidence)

    def _rollback_locked(self, to: int | None, evidence: dict[str, Any] | None) -> int:
        state = self.live_state()
        current = state["version"]
        if current is None:
            raise StoreError("nothing is live: there is nothing to roll back")
        history = [v for v in state["history"] if v != current and v in self.versions()]
        if to is None:
            if not history:
                raise StoreError(f"version {current} has no earlier live version to roll back to")
            to = history[-1]
        elif to not in self.versions():
            raise VersionNotFound(f"version {to} does not exist in {self.root}")
        if to == current:
            raise StoreError(f"version {to} is already live")
        self.update(current, status="rolled-back", rollback_evidence=evidence or {"by": "operator"})
        self.update(to, status="live", live_since=time.time(), live_reason=f"rollback from {current}")
        remaining = history[:history.index(to)] if to in history else history
        _write_json_atomic(self.root / "live.json", {"version": to, "history": remaining})
        return to

    def pin(self, version: int, pinned: bool = True) -> None:
        self.update(version, pinned=pinned)

    def gc(self) -> list[int]:
        """Delete versions that are not live, not pinned, and not among the last `keep_last`."""
        versions = self.versions()
        live = self.live_version()
        keep = set(versions[-self.keep_last:]) | {live}
        removed = []
        for version in versions:
            if version in keep or self.manifest(version).get("pinned"):
                continue
            shutil.rmtree(self.version_dir(version), ignore_errors=True)
            removed.append(version)
        return removed
