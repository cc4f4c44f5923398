"""The day-0 feature drafter: the shipped pretrained version when it fits, else a fresh one.

Contract: `day0_feature_model` returns a `FeatureDrafterModel` for a target and where it came
from ("pretrained <file>" or "from scratch"). The shipped file (made by `specd pretrain`, see
docs/pretraining.md) is used only when asked for and when it was made for this target: same fingerprint,
same width, captured layers that exist. A file made by `specd pretrain` carries its manifest (the
command that made it, the training and evaluation data's sha256, the held-out figure); when one
is there, or required (the shipped file), `check_manifest` checks those fields, that the `.json`
beside the file says the same, and that the file's sha256 is the one the `.json` names. A file
that does not fit, is corrupt or whose manifest does not check out is refused with a warning
naming why, and the drafter starts from scratch; a server never fails to start over it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from specd.core.errors import CheckpointError
from specd.drafter.checkpoint import load_drafter, read_metadata
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer

log = logging.getLogger(__name__)

SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-feature.safetensors"


SHA256 = re.compile(r"[0-9a-f]{64}")


def check_manifest(path: Path, required: bool = False) -> dict[str, Any] | None:
    """The manifest in a pretrained file's metadata, checked; None if it has none and none is required."""
    raw = read_metadata(path).get("manifest")
    if raw is None:
        if required:
            raise CheckpointError(f"{path}: no manifest (the command, data hashes and figure that made it)")
        return None
    try:
        manifest = json.loads(raw)
        command, held_out = manifest["command"], manifest["held_out"]
        hashes = [manifest["data"]["sha256"], held_out["evaluation"]["sha256"]]
        figure = held_out["accept_length"]
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: its manifest lacks {error} (command, data hashes, held-out figure)") from None
    if not isinstance(command, str) or not command.startswith("specd pretrain"):
        raise CheckpointError(f"{path}: its manifest names no `specd pretrain` command")
    if not all(isinstance(h, str) and SHA256.fullmatch(h) for h in hashes):
        raise CheckpointError(f"{path}: its manifest's data hashes are not sha256 digests")
    if not isinstance(figure, int | float) or not 1.0 <= figure <= held_out.get("k", 64) + 1:
        raise CheckpointError(f"{path}: its manifest's held-out accept length {figure!r} is not a figure")
    beside = path.with_suffix(".json")
    if beside.is_file():
        try:
            written = json.loads(beside.read_text())
            digest = written.pop("file_sha256", None)
        except (OSError, ValueError, AttributeError) as error:
            raise CheckpointError(f"{path}: {beside.name} is not a readable manifest ({error})") from None
        if written != manifest:
            raise CheckpointError(f"{path}: {beside.name} and the file's own manifest differ")
        if digest is not None and digest != hashlib.sha256(path.read_bytes()).hexdigest():
            raise CheckpointError(f"{path}: its sha256 is not the one {beside.name} names")
    return manifest


def load_pretrained(path: Path, target: Transformer, fingerprint: TargetFingerprint,
                    require_manifest: bool = False) -> FeatureDrafterModel:
    """Read a pretrained feature drafter and check that it fits `target`; CheckpointError if not."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    check_manifest(path, require_manifest)
    embedding = target.embed.weight
    model = load_drafter(path, fingerprint, embedding.dtype, embedding.device, target_embedding=embedding)
    if not isinstance(model, FeatureDrafterModel):
        raise CheckpointError(f"{path}: a token-level drafter, not a feature drafter")
    check_fits_target(path, model, target)
    return model


def check_fits_target(path: Path, model: FeatureDrafterModel, target: Transformer) -> None:
    """CheckpointError unless the drafter reads layers the target has, the last one among them, at
    its width (a file made for another target would fail in the first step that captures them)."""
    config, target_config = model.config, target.config
    layers = config.capture_layers   # increasing (the config checks it): the last one bounds them all
    if config.hidden_size != target_config.hidden_size or layers[-1] != target_config.num_layers - 1:
        raise CheckpointError(f"{path}: made for a target {config.hidden_size} wide reading layers "
                              f"{layers}; this one is {target_config.hidden_size} wide with "
                              f"{target_config.num_layers} layers")


def day0_feature_model(target: Transformer, fingerprint: TargetFingerprint | None, draft_vocab: int,
                       pretrained: Path | None = SHIPPED_DRAFTER, seed: int = 0) -> tuple[FeatureDrafterModel, str]:
    """The pretrained drafter if `pretrained` is given and fits, else a fresh one over the first ids."""
    if pretrained is not None and fingerprint is not None:
        try:
            model = load_pretrained(pretrained, target, fingerprint, require_manifest=pretrained == SHIPPED_DRAFTER)
            return model, f"pretrained {pretrained.name}"
        except CheckpointError as error:
            log.warning("not using the pretrained drafter (%s); starting from scratch", error)
    vocab = min(draft_vocab, target.config.vocab_size)
    # without data to rank tokens by, BPE ids (merges in corpus-frequency order) are the best guess
    model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                torch.arange(vocab), seed=seed)
    embedding = target.embed.weight
    model = model.to(device=embedding.device, dtype=embedding.dtype)
    model.embedding = embedding.detach()
    return model, "from scratch"
