"""A served target: its checkpoint folder, weights, tokenizer and stop tokens, loaded together.

Contract: `LoadedTarget.load(path)` takes a Hugging Face checkpoint folder, or None for the
embedded default (SmolLM2-135M-Instruct, converted once from the bundled GGUF), and returns the
model plus what turns text into prompt ids and ids back into text. Tokenizers and chat templates
come from transformers; the engine itself never sees text. What a user can get wrong (an unknown
dtype or device, a folder without config.json or without a tokenizer) is refused in one line, as
`ConfigurationError` or `CheckpointError`, before the weights load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd.core.errors import CheckpointError, ConfigurationError, RequestRefused
from specd.model.bundled import bundled_target_dir
from specd.model.fingerprint import TargetFingerprint
from specd.model.loading import load_target, read_config
from specd.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = "cpu, cuda or cuda:N"  # what the engine runs on, as --device help and errors say it
# files any of which holds a tokenizer transformers can load (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_device(device: str) -> None:
    """Refuse, before anything loads, a device the engine cannot run on or this machine lacks."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message lists every backend it was built to know
        raise ConfigurationError(f"unknown device {device!r}; use {DEVICES}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device {device!r} is not supported; use {DEVICES}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"--device {device} was asked for, but torch sees no CUDA device here")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ConfigurationError(f"--device {device}: torch sees only {torch.cuda.device_count()} CUDA device(s)")


def load_tokenizer(folder: Path) -> Any:
    """The folder's transformers tokenizer, or CheckpointError in one line (transformers' own
    messages run to several lines and do not say which folder)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # transformers and tokenizers raise assorted types for one bad file
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise CheckpointError(f"{folder}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                  "copy the checkpoint's tokenizer files into the folder") from None
        reason = " ".join(str(error).split()) or type(error).__name__
        raise CheckpointError(f"{folder}: no usable tokenizer ({reason[:300]})") from None


def generation_eos_ids(folder: Path) -> list[int]:
    """`eos_token_id` of the folder's generation_config.json (an id or a list of ids); none when the
    file is missing or says nothing usable (it only adds stops to the tokenizer's)."""
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return []
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    listed = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in listed if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


@dataclass
class LoadedTarget:
    folder: Path
    model: Transformer
    tokenizer: Any  # a transformers tokenizer

    @classmethod
    def load(cls, path: str | Path | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedTarget:
        if dtype not in DTYPES:
            raise ConfigurationError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
        check_device(device)
        folder = Path(path) if path is not None else bundled_target_dir()
        read_config(folder)  # a missing or broken config.json is the first thing to say, and cheap
        tokenizer = load_tokenizer(folder)  # before the weights: a missing tokenizer is found in a moment
        return cls(folder, load_target(folder, DTYPES[dtype], device), tokenizer)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS and those `generation_config.json` lists (as vLLM and transformers read
        them): chat models often end a turn on a token other than the tokenizer's EOS."""
        eos = self.tokenizer.eos_token_id
        ids = [] if eos is None else [int(eos)]
        return tuple(dict.fromkeys(ids + generation_eos_ids(self.folder)))

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

    def shared_prefixes(self) -> tuple[tuple[int, ...], ...]:
        """Prompt openings worth prefilling once (the engine's `shared_prefixes`): the tokens every
        one-message chat prompt starts with, the template's system prompt and the user turn's opening;
        none where there is no chat template."""
        try:
            one, other = (self.encode_messages([{"role": "user", "content": text}]) for text in ("a", "b"))
        except Exception:  # no chat template (transformers raises ValueError; other tokenizers differ)
            return ()
        shared = min(len(one), len(other))
        shared = next((i for i in range(shared) if one[i] != other[i]), shared)
        return (tuple(one[:shared]),) if shared else ()

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
