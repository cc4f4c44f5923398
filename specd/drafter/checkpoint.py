"""Drafter checkpoints: one safetensors file with the drafter's shape and its target's fingerprint.

Two formats: "drafter/1" (a token-level `Transformer`) and "feature-drafter/2" (a
`FeatureDrafterModel`, EAGLE-3's layer, its config and draft vocabulary in the file, the target's
embedding never stored); `load_drafter` reads either, and refuses "feature-drafter/1" (the
earlier, non-EAGLE-3 layer) with a message saying so. `save_drafter(..., dtype=torch.float16)` halves the file.

Contract: `save_drafter` writes weights only through safetensors (never pickle), with metadata
holding the drafter's ModelConfig and the target fingerprint (vocabulary size and tokenizer
hash). An embedding identical to the target's (the drafter starts from it and keeps it frozen)
is not stored: the file says so, and the loader takes it from the target, which keeps versions
small (a 1-layer drafter: ~35 MB instead of ~150 MB) and swaps cheap. `load_drafter` refuses,
with `CheckpointError` naming the problem, a file that is not safetensors, lacks that metadata,
was made for another target, has missing or wrongly shaped tensors, or holds non-finite values.
A file is untrusted until checked: its config's bounds and its header's tensor shapes are
compared (on a meta-device skeleton) before any tensor is read or any model is allocated.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specd.core.errors import CheckpointError
from specd.drafter.feature_model import FeatureDrafterConfig, FeatureDrafterModel
from specd.model.fingerprint import TargetFingerprint
from specd.model.loading import check_shapes, load_state_into
from specd.model.transformer import ModelConfig, Transformer

FEATURE_FORMAT = "feature-drafter/2"

# either kind of learned drafter network
DrafterModel = Transformer | FeatureDrafterModel


def clone_drafter(model: DrafterModel) -> DrafterModel:
    """An independent copy of the weights (a feature drafter keeps sharing the target's embedding)."""
    if isinstance(model, FeatureDrafterModel):
        return model.clone()
    return copy.deepcopy(model)


def save_drafter(model: DrafterModel, path: str | Path, fingerprint: TargetFingerprint,
                 extra: dict[str, str] | None = None, target_embedding: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """Write the drafter; an embedding identical to `target_embedding` is not stored but referenced."""
    if isinstance(model, FeatureDrafterModel):
        _save_feature_drafter(model, path, fingerprint, extra, dtype)
        return
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


def _save_feature_drafter(model: FeatureDrafterModel, path: str | Path, fingerprint: TargetFingerprint,
                          extra: dict[str, str] | None, dtype: torch.dtype | None) -> None:
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    metadata = {"specd_format": FEATURE_FORMAT, "embedding": "target",
                "feature_config": json.dumps(model.config.as_dict()),
                "target_fingerprint": json.dumps(dataclasses.asdict(fingerprint)), **(extra or {})}
    save_file(state, str(path), metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def load_drafter(path: str | Path, expect: TargetFingerprint | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 target_embedding: torch.Tensor | None = None) -> DrafterModel:
    """Read and check a drafter; `target_embedding` fills in an embedding the file shares with the target.

    The file is untrusted until checked: its config must be within `MAX_POSITION` and describe
    exactly the tensors its header lists (compared on a model built on the meta device, which
    allocates nothing) before any tensor is read or any real model is built."""
    metadata = read_metadata(path)
    if metadata.get("specd_format") == FEATURE_FORMAT:
        return _load_feature_drafter(path, metadata, expect, dtype, device, target_embedding)
    if metadata.get("specd_format") == "feature-drafter/1":
        raise CheckpointError(f"{path}: a feature drafter of the earlier layout (feature-drafter/1); this specd "
                              f"serves EAGLE-3's layer ({FEATURE_FORMAT}): pretrain or train it again")
    if metadata.get("specd_format") != "drafter/1":
        raise CheckpointError(f"{path}: not a specd drafter checkpoint (format {metadata.get('specd_format')!r})")
    try:
        config_fields = json.loads(metadata["model_config"])
        if config_fields.get("rope_llama3") is not None:
            config_fields["rope_llama3"] = tuple(config_fields["rope_llama3"])
        config = ModelConfig(**config_fields)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable drafter metadata ({error})") from None
    _check_fingerprint(metadata, path, expect)
    shared = metadata.get("embedding") == "target"
    if shared:
        _check_target_embedding(path, target_embedding, config.vocab_size, config.hidden_size)
    header = _header_shapes(path)
    if shared:
        header["embed.weight"] = (config.vocab_size, config.hidden_size)
    layers_in_file = {name.split(".")[1] for name in header if name.startswith("blocks.")}
    if len(layers_in_file) != config.num_layers:  # before the skeleton: its size follows num_layers
        raise CheckpointError(f"{path}: its config has {config.num_layers} layers, its tensors {len(layers_in_file)}")
    _check_config(path, config.max_position, header, lambda: Transformer(config))
    state = _read_state(path)
    _check_finite(state, path)
    if shared:
        assert target_embedding is not None
        state["embed.weight"] = target_embedding.detach().to("cpu", torch.float32)
    model = Transformer(config)
    load_state_into(model, state, str(path))
    return model.to(device=device, dtype=dtype).eval()


MAX_POSITION = 1 << 17  # rotary tables are sized by a drafter's max_position: a bound on what a file can ask for


def _check_config(path: str | Path, max_position: int, header: dict[str, tuple[int, ...]],
                  build: Callable[[], torch.nn.Module]) -> None:
    """Refuse a config out of bounds, or one whose model's tensors are not the file's, before
    anything is allocated: the model is built on the meta device and only its shapes are read."""
    if not 0 < max_position <= MAX_POSITION:
        raise CheckpointError(f"{path}: max_position {max_position} is outside (0, {MAX_POSITION}]")
    try:
        with torch.device("meta"):
            skeleton = build()
    except (ValueError, RuntimeError, TypeError) as error:
        raise CheckpointError(f"{path}: its config describes no valid drafter ({error})") from None
    check_shapes({name: tuple(t.shape) for name, t in skeleton.state_dict().items()}, header, str(path),
                 tied=getattr(skeleton.config, "tie_embeddings", False))


def _check_target_embedding(path: str | Path, embedding: torch.Tensor | None, vocab: int, hidden: int) -> None:
    if embedding is None:
        raise CheckpointError(f"{path}: shares the target's embedding; load it with the target's embedding")
    if tuple(embedding.shape) != (vocab, hidden):
        raise CheckpointError(f"{path}: the target's embedding has shape {tuple(embedding.shape)}, "
                              f"expected {(vocab, hidden)}")


def _read_fingerprint(metadata: dict[str, str], path: str | Path) -> TargetFingerprint:
    try:
        return TargetFingerprint(**json.loads(metadata["target_fingerprint"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable target fingerprint ({error})") from None


def _check_fingerprint(metadata: dict[str, str], path: str | Path, expect: TargetFingerprint | None) -> None:
    fingerprint = _read_fingerprint(metadata, path)
    if expect is not None and fingerprint != expect:
        raise CheckpointError(f"{path}: made for target {fingerprint}, this target is {expect}")


def _header_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the file's header, without reading any tensor."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: unreadable tensors ({error})") from None


def check_contents(path: str | Path, like: str | Path | None = None) -> None:
    """What can be checked of a drafter file without its target: a specd format, every tensor
    readable, every value finite (CheckpointError otherwise). `load_drafter` checks the rest.
    With `like` (a file servers load now, such as the live version's), also the same target
    fingerprint, format and tensor shapes as that file where it can be read: a drafter made for
    another target, or of another shape, is refused without loading the target."""
    metadata = read_metadata(path)
    format_name = metadata.get("specd_format")
    if format_name not in (FEATURE_FORMAT, "drafter/1"):
        raise CheckpointError(f"{path}: not a specd drafter checkpoint (format {format_name!r})")
    if like is not None:
        _check_like(path, metadata, like)
    _check_finite(_read_state(path), path)


def _check_like(path: str | Path, metadata: dict[str, str], like: str | Path) -> None:
    try:
        reference, expected = read_metadata(like), _header_shapes(like)
        theirs = _read_fingerprint(reference, like)
    except CheckpointError:  # nothing to compare with: the other checks stand alone
        return
    ours = _read_fingerprint(metadata, path)
    if ours != theirs:
        raise CheckpointError(f"{path}: made for another target than {like} ({ours} against {theirs})")
    if metadata.get("specd_format") != reference.get("specd_format"):
        raise CheckpointError(f"{path}: format {metadata.get('specd_format')!r}, {like} is "
                              f"{reference.get('specd_format')!r}")
    shapes = _header_shapes(path)
    if shapes != expected:
        differ = sorted(name for name in set(shapes) | set(expected) if shapes.get(name) != expected.get(name))
        raise CheckpointError(f"{path}: tensors of other shapes than {like}'s "
                              f"({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''})")


def _read_state(path: str | Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: unreadable tensors ({error})") from None


def _check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise CheckpointError(f"{path}: non-finite values in {bad[:5]}")


def _load_feature_drafter(path: str | Path, metadata: dict[str, str], expect: TargetFingerprint | None,
                          dtype: torch.dtype, device: str | torch.device,
                          target_embedding: torch.Tensor | None) -> FeatureDrafterModel:
    try:
        config = FeatureDrafterConfig.from_dict(json.loads(metadata["feature_config"]))
        config.layer_config()  # its decoder layer's shape is checked here, not while building the model
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable feature-drafter metadata ({error})") from None
    _check_fingerprint(metadata, path, expect)
    if target_embedding is None:
        raise CheckpointError(f"{path}: a feature drafter reads the target's embedding; load it with the target's")
    _check_target_embedding(path, target_embedding, config.vocab_size, config.hidden_size)
    _check_config(path, config.max_position, _header_shapes(path), lambda: FeatureDrafterModel(
        config, torch.empty(config.vocab_size, config.hidden_size),
        torch.zeros(config.draft_vocab_size, dtype=torch.long)))
    state = _read_state(path)
    _check_finite(state, path)
    draft_ids = state.get("draft_ids")
    if draft_ids is None or tuple(draft_ids.shape) != (config.draft_vocab_size,) or draft_ids.is_floating_point() \
            or int(draft_ids.min()) < 0 or int(draft_ids.max()) >= config.vocab_size \
            or len(draft_ids.unique()) != len(draft_ids):
        raise CheckpointError(f"{path}: draft_ids must be {config.draft_vocab_size} distinct target ids "
                              f"in [0, {config.vocab_size})")
    model = FeatureDrafterModel(config, target_embedding.detach().to("cpu", torch.float32), draft_ids)
    state = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    load_state_into(model, state, str(path))
    model = model.to(device=device, dtype=dtype).eval()
    model.embedding = target_embedding.detach().to(device=device, dtype=dtype)
    return model
