"""Load Hugging Face checkpoint folders (config.json + *.safetensors) into `Transformer`.

Contract: `load_target(path)` returns a model in eval mode with every weight filled, or raises
`CheckpointError` naming the file and what does not fit: a config.json that is not a JSON object,
an unknown architecture, an unsupported setting, a weight file that is not readable safetensors, a
missing or unexpected tensor, a tensor of the wrong shape. `read_config` and `read_target_head`
refuse the same way. Weights are read with safetensors only (never pickle). q/k/v and gate/up
projections are fused here, once, at load time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specd.core.errors import CheckpointError
from specd.model.transformer import ModelConfig, Transformer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config dict into a ModelConfig, refusing what we do not run."""
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list):
        raise CheckpointError(f"{source}: architectures should be a list of class names, got {architectures!r}")
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures
                   if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise CheckpointError(f"{source}: unsupported architecture {architectures or '(none given)'}; "
                              f"specd runs {sorted(SUPPORTED_ARCHITECTURES)}")
    # transformers 5 writes rope settings as rope_parameters; older configs use rope_scaling
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope settings should be an object, got {type(rope).__name__}")
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default", "llama3"):
        raise CheckpointError(f"{source}: rope scaling {kind!r} is not supported (only llama3)")
    try:
        rope_llama3 = None if kind != "llama3" else (
            float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]))
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_llama3=rope_llama3,
        )
    except KeyError as missing:
        raise CheckpointError(f"{source}: missing field {missing}") from None
    except (ValueError, TypeError, ZeroDivisionError) as bad:  # a field of the wrong type, or zero heads
        raise CheckpointError(f"{source}: {bad}") from None


def _hf_to_specd(config: ModelConfig, read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and fuse) HF tensors into this package's parameter names; pops what it uses."""
    out: dict[str, torch.Tensor] = {"embed.weight": read.pop("model.embed_tokens.weight"),
                                    "norm.weight": read.pop("model.norm.weight")}
    if not config.tie_embeddings:
        out["lm_head.weight"] = read.pop("lm_head.weight")
    for i in range(config.num_layers):
        hf, me = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        out[me + "attn.qkv.weight"] = torch.cat([read.pop(attn + f"{p}_proj.weight") for p in "qkv"])
        if config.attention_bias:
            out[me + "attn.qkv.bias"] = torch.cat([read.pop(attn + f"{p}_proj.bias") for p in "qkv"])
        out[me + "attn.o.weight"] = read.pop(attn + "o_proj.weight")
        if config.qk_norm:
            out[me + "attn.q_norm.weight"] = read.pop(attn + "q_norm.weight")
            out[me + "attn.k_norm.weight"] = read.pop(attn + "k_norm.weight")
        out[me + "mlp.gate_up.weight"] = torch.cat([read.pop(hf + "mlp.gate_proj.weight"),
                                                    read.pop(hf + "mlp.up_proj.weight")])
        out[me + "mlp.down.weight"] = read.pop(hf + "mlp.down_proj.weight")
        out[me + "attn_norm.weight"] = read.pop(hf + "input_layernorm.weight")
        out[me + "mlp_norm.weight"] = read.pop(hf + "post_attention_layernorm.weight")
    return out


def check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str,
                 tied: bool = False) -> None:
    """Refuse missing, unexpected or wrongly shaped tensors by name (`tied`: the output head is
    the embedding and is not stored)."""
    if tied:
        expected = {name: shape for name, shape in expected.items() if name != "lm_head.weight"}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(shape)}, expected {tuple(expected[name])}")


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `model`, refusing missing, unexpected or wrongly shaped tensors by name."""
    params = dict(model.state_dict())
    tied = getattr(model.config, "tie_embeddings", False)
    check_shapes({name: tuple(p.shape) for name, p in params.items()},
                 {name: tuple(t.shape) for name, t in state.items()}, source, tied)
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder's config.json, or CheckpointError naming the file."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_file}: cannot be read ({error})") from None
    except json.JSONDecodeError as error:  # truncated or hand-edited: say where it stops being JSON
        raise CheckpointError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(hf).__name__}")
    return config_from_hf(hf, str(config_file))


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    return files


def _read_tensors(file: Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file whose names pass `wanted`; CheckpointError for a file that
    is garbage, truncated or unreadable (safetensors' own error names neither the file nor the fix)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            names = [name for name in handle.keys() if wanted(name)]  # noqa: SIM118 (safe_open is not iterable)
            return {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error}); "
                              "re-download or re-save the checkpoint") from None


def read_target_head(path: str | Path) -> tuple[ModelConfig, torch.Tensor, torch.Tensor]:
    """The target's config, input embedding and output layer (the same tensor when tied), in float32.

    Reads only those tensors, not the whole checkpoint: what a drafter needs from its target
    inside another engine's process (vLLM's worker) that already holds the target's weights.
    """
    folder = Path(path)
    config = read_config(folder)
    wanted: dict[str, torch.Tensor | None] = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for file in _weight_files(folder):
        for name, tensor in _read_tensors(file, lambda name: name in wanted).items():
            wanted[name] = tensor.float()
    embed = wanted["model.embed_tokens.weight"]
    if embed is None:
        raise CheckpointError(f"{folder}: missing tensor 'model.embed_tokens.weight'")
    head = embed if config.tie_embeddings else wanted["lm_head.weight"]
    if head is None:
        raise CheckpointError(f"{folder}: missing tensor 'lm_head.weight'")
    return config, embed, head


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """Build and fill a Transformer from a Hugging Face checkpoint folder."""
    folder = Path(path)
    config = read_config(folder)
    read: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        read.update(_read_tensors(file, lambda name: True))
    if config.tie_embeddings:
        read.pop("lm_head.weight", None)  # some tied checkpoints still store the copy
    try:
        state = _hf_to_specd(config, read)
    except KeyError as missing:
        raise CheckpointError(f"{folder}: missing tensor {missing}") from None
    leftovers = sorted(name for name in read if not name.endswith("rotary_emb.inv_freq"))
    if leftovers:
        raise CheckpointError(f"{folder}: unexpected tensors {leftovers[:5]}")
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    load_state_into(model, {k: v.to(dtype) for k, v in state.items()}, str(folder))
    return model.eval()
