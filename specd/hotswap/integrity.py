"""Is a version's file what its manifest promises? The one check of weights on their way to serving.

Contract: `sha256_file` is the digest the store writes into every manifest. `check_digest` raises
when a file's sha256 differs from its manifest's, as the caller's kind of error (the store's
`StoreError`: it will not make such a version live; everyone else's `CheckpointError`: the
version is refused). `load_verified` is what every swap runs, off the decoding thread: the
digest, then `load_drafter` (safetensors metadata and format, the target's fingerprint, tensor
names and shapes, finite values) in the serving model's dtype and device, then the serving side's
own `check_compatible`; `check_servable` the same without a serving drafter (the control plane,
before an operator's version goes live); `check_contents_of` the digest and what needs no target
(format, readable tensors, finite values, and the fingerprint and shapes of a file servers load
now: the CLI's `--store` path). The store, the swapper, the remote source and vLLM's launcher all
check through here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from specd.core.errors import CheckpointError, SpecdError
from specd.drafter.checkpoint import DrafterModel, check_contents, load_drafter
from specd.drafter.swap import Swappable
from specd.model.fingerprint import TargetFingerprint


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_digest(version: int, digest: str, manifest: dict[str, Any],
                 error: type[SpecdError] = CheckpointError) -> None:
    """Raise `error` unless `digest` (of version `version`'s weights) is the manifest's sha256."""
    expected = str(manifest.get("sha256"))
    if digest != expected:
        raise error(f"version {version}: its weights' sha256 {digest[:12]}… does not match the manifest's "
                    f"{expected[:12]}…")


def check_file(version: int, path: Path, manifest: dict[str, Any],
               error: type[SpecdError] = CheckpointError) -> None:
    check_digest(version, sha256_file(path), manifest, error)


def check_servable(version: int, path: Path, manifest: dict[str, Any], fingerprint: TargetFingerprint,
                   target_embedding: torch.Tensor | None = None) -> None:
    """Raise CheckpointError unless version `version` is what a server of this target would load:
    the digest, then the whole file read and checked (without a serving drafter to offer it to)."""
    check_file(version, path, manifest)
    load_drafter(path, fingerprint, target_embedding=target_embedding)


def check_contents_of(version: int, path: Path, manifest: dict[str, Any], like: Path | None = None) -> None:
    """The digest, then what can be checked without the target (`checkpoint.check_contents`,
    against `like`, a file servers load now, where given): for tools that load no target, such as
    `specd rollback --store`."""
    check_file(version, path, manifest)
    check_contents(path, like)


def load_verified(version: int, path: Path, manifest: dict[str, Any], fingerprint: TargetFingerprint,
                  serving: Swappable, target_embedding: torch.Tensor | None = None) -> DrafterModel:
    """Version `version`'s weights, checked in full, ready for `serving.offer`."""
    check_file(version, path, manifest)
    weight = next(serving.model.parameters())
    model = load_drafter(path, fingerprint, weight.dtype, weight.device, target_embedding=target_embedding)
    serving.check_compatible(model)
    return model
