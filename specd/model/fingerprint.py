"""A target's fingerprint: what a drafter must match to serve beside it.

Contract: `TargetFingerprint.of(config, folder)` is the vocabulary size and the sha256 of the
target's tokenizer.json ("none" for tokenizer-less test models). Drafter checkpoints carry it,
and a server refuses weights whose fingerprint differs from its target's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from specd.model.transformer import ModelConfig


@dataclasses.dataclass(frozen=True)
class TargetFingerprint:
    vocab_size: int
    tokenizer_hash: str  # sha256 of the target's tokenizer.json, or "none" for tokenizer-less tests

    @classmethod
    def of(cls, config: ModelConfig, target_dir: str | Path | None = None) -> TargetFingerprint:
        tokenizer_file = Path(target_dir) / "tokenizer.json" if target_dir is not None else None
        digest = "none"
        if tokenizer_file is not None and tokenizer_file.is_file():
            digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
        return cls(config.vocab_size, digest)
