"""A feature drafter in vLLM's EAGLE-3 format: the folder vLLM's `eagle3` method loads, and the
tensors a running vLLM drafter takes in place.

Contract (plain torch, no vLLM import):
- `export_eagle3(model, folder, target_dir, fingerprint, version)` writes `config.json` (a Llama config with
  `architectures: ["Eagle3LlamaForCausalLM"]`, the draft vocabulary size, `fc_norm`, the
  auxiliary layer ids = capture layers + 1, the target's rope settings) and `model.safetensors`
  with EAGLE-3's checkpoint names (`fc`, `fc_norm.i`, `midlayer.*` and, past one layer,
  `layers.i.*`, with q/k/v and gate/up split, `norm`, `lm_head`, `d2t` as offsets; no embedding:
  vLLM shares the target's) and, beside them,
  the same version as a specd checkpoint (`SPECD_CHECKPOINT`, naming the version), which the
  worker side reads to know what it serves.
- `vllm_parameters(model)` gives the same weights under the parameter names of vLLM's loaded
  `Eagle3LlamaForCausalLM` (q/k/v and gate/up stacked as vLLM stacks them), for in-place swaps.
Only Llama-shaped targets (no attention bias, no q/k norms) are exported; others raise ValueError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specd.drafter.checkpoint import save_drafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.model.fingerprint import TargetFingerprint

EAGLE3_ARCHITECTURE = "Eagle3LlamaForCausalLM"
SPECD_CHECKPOINT = "specd/drafter.safetensors"  # in a subfolder: vLLM loads every *.safetensors beside config.json
# the target config keys that set rotary embeddings (transformers 4 and 5 spell them differently)
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def _check_exportable(model: FeatureDrafterModel) -> None:
    layer = model.config.layer_config()
    if layer.attention_bias or layer.qk_norm:
        raise ValueError("vLLM's EAGLE-3 drafter is Llama-shaped: a target with attention biases or q/k norms "
                         "cannot be exported")


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's draft -> target map: target id = draft index + d2t[draft index]."""
    return (draft_ids.to(torch.long) - torch.arange(len(draft_ids), device=draft_ids.device)).cpu()


def vllm_parameters(model: FeatureDrafterModel) -> dict[str, torch.Tensor]:
    """The drafter's weights under vLLM's loaded parameter names (never the shared embedding)."""
    _check_exportable(model)
    layer = "model.layers.0."
    tensors: dict[str, Any] = {f"model.fc_norm.{i}.weight": norm.weight for i, norm in enumerate(model.fc_norms)}
    tensors.update({
        "model.fc.weight": model.fc.weight,
        layer + "input_layernorm.weight": model.input_norm.weight,
        layer + "hidden_norm.weight": model.hidden_norm.weight,
        layer + "self_attn.qkv_proj.weight": model.attn.qkv.weight,   # [q; k; v], as vLLM stacks them
        layer + "self_attn.o_proj.weight": model.attn.o.weight,
        layer + "post_attention_layernorm.weight": model.post_norm.weight,
        layer + "mlp.gate_up_proj.weight": model.mlp.gate_up.weight,  # [gate; up], as vLLM stacks them
        layer + "mlp.down_proj.weight": model.mlp.down.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.head.weight,
    })
    for index, block in enumerate(model.deeper, start=1):  # plain Llama layers after the first
        deeper = f"model.layers.{index}."
        tensors.update({
            deeper + "input_layernorm.weight": block.attn_norm.weight,
            deeper + "self_attn.qkv_proj.weight": block.attn.qkv.weight,
            deeper + "self_attn.o_proj.weight": block.attn.o.weight,
            deeper + "post_attention_layernorm.weight": block.mlp_norm.weight,
            deeper + "mlp.gate_up_proj.weight": block.mlp.gate_up.weight,
            deeper + "mlp.down_proj.weight": block.mlp.down.weight,
        })
    out: dict[str, torch.Tensor] = {name: tensor.detach() for name, tensor in tensors.items()}
    out["draft_id_to_target_id"] = d2t_offsets(model.get_buffer("draft_ids"))
    return out


def checkpoint_tensors(model: FeatureDrafterModel, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's weights under EAGLE-3's checkpoint names, as vLLM's loader reads them."""
    q_size, kv_size, _ = model.attn.split
    parameters = vllm_parameters(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in parameters.items():
        if name == "draft_id_to_target_id":
            out["d2t"] = tensor
            continue
        short = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        if short.endswith("qkv_proj.weight"):
            q, k, v = tensor.split((q_size, kv_size, kv_size))
            for part, piece in (("q", q), ("k", k), ("v", v)):
                out[short.replace("qkv_proj", f"{part}_proj")] = piece
        elif short.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            out[short.replace("gate_up_proj", "gate_proj")] = gate
            out[short.replace("gate_up_proj", "up_proj")] = up
        else:
            out[short] = tensor
    return {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
            for name, t in out.items()}


def eagle3_config(model: FeatureDrafterModel, target_config: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's view of the drafter: a Llama config with EAGLE-3's fields."""
    cfg = model.config
    config: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": target_config.get("max_position_embeddings", cfg.max_position),
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "tie_word_embeddings": False,
        "target_hidden_size": cfg.hidden_size, "fc_norm": True, "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in cfg.capture_layers],
                         "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    config.update({key: target_config[key] for key in ROPE_KEYS if key in target_config})
    if extra:
        config["specd"] = extra
    return config


def export_eagle3(model: FeatureDrafterModel, folder: str | Path, target_dir: str | Path,
                  fingerprint: TargetFingerprint, version: int) -> Path:
    """Write the folder vLLM's `eagle3` method loads (and specd's copy beside it); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    save_file(checkpoint_tensors(model), str(folder / "model.safetensors"))
    (folder / SPECD_CHECKPOINT).parent.mkdir(exist_ok=True)
    # safetensors metadata values are strings
    save_drafter(model, folder / SPECD_CHECKPOINT, fingerprint, extra={"specd_version": str(version)})
    config = eagle3_config(model, target_config, {"version": version})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
