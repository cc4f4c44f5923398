"""A served target: its checkpoint folder, weights, tokenizer and stop tokens, loaded together.

Contract: `LoadedTarget.load(path)` takes a Hugging Face checkpoint folder, or None for the
embedded default (SmolLM2-135M-Instruct, converted once from the bundled GGUF), and returns the
model plus what turns text into prompt ids and ids back into text. Tokenizers and chat templates
come from transformers; the engine itself never sees text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd.core.errors import CheckpointError, ConfigurationError, RequestRefused
from specd.model.bundled import bundled_target_dir
from specd.model.fingerprint import TargetFingerprint
from specd.model.loading import load_target
from specd.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedTarget:
    folder: Path
    model: Transformer
    tokenizer: Any  # a transformers tokenizer

    @classmethod
    def load(cls, path: str | Path | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedTarget:
        if dtype not in DTYPES:
            raise ConfigurationError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigurationError("--device cuda was asked for, but torch sees no CUDA device here")
        folder = Path(path) if path is not None else bundled_target_dir()
        model = load_target(folder, DTYPES[dtype], device)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{folder}: no usable tokenizer ({error})") from None
        return cls(folder, model, tokenizer)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def fingerprint(self) -> TargetFingerprint:
        return TargetFingerprint.of(self.model.config, self.folder)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text (or one user message, with chat) to token ids; never empty."""
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return self.encode_messages(messages)
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise RequestRefused("the prompt is empty and the tokenizer has no BOS token to start from")
            ids = [int(bos)]  # an empty prompt starts from BOS, as a fresh document would
        return ids

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
