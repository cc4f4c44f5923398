"""Drafter checkpoints: one safetensors file with the drafter's shape and its target's fingerprint.

Contract: `save_drafter` writes weights only through safetensors (never pickle), with metadata
holding the drafter's ModelConfig and the target fingerprint (vocabulary size and tokenizer
hash). An embedding identical to the target's (the drafter starts from it and keeps it frozen)
is not stored: the file says so, and the loader takes it from the target, which keeps versions
small (a 1-layer drafter: ~35 MB instead of ~150 MB) and swaps cheap. `load_drafter` refuses,
with `CheckpointError` naming the problem, a file that is not safetensors, lacks that metadata,
was made for another target, has missing or wrongly shaped tensors, or holds non-finite values.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specd.errors import CheckpointError
from specd.model.checkpoint import load_state_into
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import ModelConfig, Transformer


def save_drafter(model: Transformer, path: str | Path, fingerprint: TargetFingerprint,
                 extra: dict[str, str] | None = None, target_embedding: torch.Tensor | None = None) -> None:
    """Write the drafter; an embedding identical to `target_embedding` is not stored but referenced."""
    shares = target_embedding is not None and tuple(target_embedding.shape) == tuple(model.embed.weight.shape) and \
        torch.equal(model.embed.weight.detach().to(target_embedding.dtype).cpu(), target_embedding.detach().cpu())
    skip = {"embed.weight"} if shares else set()
    if model.config.tie_embeddings:
        skip.add("lm_head.weight")
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()
             if name not in skip}
    metadata = {"specd_format": "drafter/1", "embedding": "target" if shares else "stored",
                "model_config": json.dumps(dataclasses.asdict(model.config)),
                "target_fingerprint": json.dumps(dataclasses.asdict(fingerprint)),
                **(extra or {})}
    save_file(state, str(path), metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def load_drafter(path: str | Path, expect: TargetFingerprint | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 target_embedding: torch.Tensor | None = None) -> Transformer:
    """Read and check a drafter; `target_embedding` fills in an embedding the file shares with the target."""
    metadata = read_metadata(path)
    if metadata.get("specd_format") != "drafter/1":
        raise CheckpointError(f"{path}: not a specd drafter checkpoint (format {metadata.get('specd_format')!r})")
    try:
        config_fields = json.loads(metadata["model_config"])
        if config_fields.get("rope_llama3") is not None:
            config_fields["rope_llama3"] = tuple(config_fields["rope_llama3"])
        config = ModelConfig(**config_fields)
        fingerprint = TargetFingerprint(**json.loads(metadata["target_fingerprint"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable drafter metadata ({error})") from None
    if expect is not None and fingerprint != expect:
        raise CheckpointError(f"{path}: made for target {fingerprint}, this target is {expect}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            state = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: unreadable tensors ({error})") from None
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise CheckpointError(f"{path}: non-finite values in {bad[:5]}")
    if metadata.get("embedding") == "target":
        if target_embedding is None:
            raise CheckpointError(f"{path}: shares the target's embedding; load it with the target's embedding")
        if tuple(target_embedding.shape) != (config.vocab_size, config.hidden_size):
            raise CheckpointError(f"{path}: the target's embedding has shape {tuple(target_embedding.shape)}, "
                                  f"expected {(config.vocab_size, config.hidden_size)}")
        state["embed.weight"] = target_embedding.detach().to("cpu", torch.float32)
    model = Transformer(config)
    load_state_into(model, state, str(path))
    return model.to(device=device, dtype=dtype).eval()
