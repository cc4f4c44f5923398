"""The day-0 feature drafter: the shipped pretrained version when it fits, else a fresh one.

Contract: `day0_feature_model` returns a `FeatureDrafterModel` for a target and where it came
from ("pretrained <file>" or "from scratch"). The shipped file (made by `specd pretrain`, see the
README) is used only when asked for and when it was made for this target: same fingerprint,
same width, captured layers that exist. A file that does not fit or is corrupt is refused with a
warning naming why, and the drafter starts from scratch; a server never fails to start over it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specd.drafter.checkpoint import load_drafter
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.errors import CheckpointError
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer

log = logging.getLogger(__name__)

SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m-feature.safetensors"


def load_pretrained(path: Path, target: Transformer, fingerprint: TargetFingerprint) -> FeatureDrafterModel:
    """Read a pretrained feature drafter and check that it fits `target`; CheckpointError if not."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    embedding = target.embed.weight
    model = load_drafter(path, fingerprint, embedding.dtype, embedding.device, target_embedding=embedding)
    if not isinstance(model, FeatureDrafterModel):
        raise CheckpointError(f"{path}: a token-level drafter, not a feature drafter")
    config, target_config = model.config, target.config
    if config.hidden_size != target_config.hidden_size or config.capture_layers[-1] != target_config.num_layers - 1:
        raise CheckpointError(f"{path}: made for a target {config.hidden_size} wide reading layers "
                              f"{config.capture_layers}; this one is {target_config.hidden_size} wide with "
                              f"{target_config.num_layers} layers")
    return model


def day0_feature_model(target: Transformer, fingerprint: TargetFingerprint | None, draft_vocab: int,
                       pretrained: Path | None = SHIPPED_DRAFTER, seed: int = 0) -> tuple[FeatureDrafterModel, str]:
    """The pretrained drafter if `pretrained` is given and fits, else a fresh one over the first ids."""
    if pretrained is not None and fingerprint is not None:
        try:
            return load_pretrained(pretrained, target, fingerprint), f"pretrained {pretrained.name}"
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
