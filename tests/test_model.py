"""The Llama-family model and its checkpoint loader, checked against transformers' own models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_target
from safetensors.torch import load_file, save_file

from specd.core.errors import CheckpointError
from specd.model.loading import load_target
from specd.model.transformer import attend_few

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def save_tiny_hf(folder: Path, family: str, tie: bool = False) -> torch.nn.Module:
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)  # layer norms and biases too, so a swapped name would show
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tie", [False, True])
def test_loads_hf_checkpoint_and_matches_its_logits(tmp_path: Path, family: str, tie: bool) -> None:
    reference = save_tiny_hf(tmp_path, family, tie)
    model = load_target(tmp_path)
    tokens = torch.tensor([[3, 17, 42, 5, 9, 60, 1]])
    with torch.no_grad():
        expected = reference(tokens).logits
        logits, _ = model(tokens, torch.tensor([0]), model.new_cache(1, 16))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_matches_one_pass() -> None:
    model = tiny_target()
    tokens = torch.tensor([[3, 17, 42, 5, 9, 60, 1, 8]])
    cache = model.new_cache(1, 16)
    full, _ = model(tokens, torch.tensor([0]), cache)
    cache = model.new_cache(1, 16)
    steps = [model(tokens[:, i:i + 1], torch.tensor([i]), cache)[0] for i in range(tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_rows_at_different_positions_match_running_alone() -> None:
    model = tiny_target()
    prompts = [[3, 17, 42, 5, 9], [60, 1]]
    alone = []
    for prompt in prompts:
        logits, _ = model(torch.tensor([prompt]), torch.tensor([0]), model.new_cache(1, 16))
        alone.append(logits[0, -1])
    cache = model.new_cache(2, 16)
    model(torch.tensor([prompts[0][:-1]]), torch.tensor([0]), cache, first_slot=0)
    model(torch.tensor([prompts[1][:-1]]), torch.tensor([0]), cache, first_slot=1)
    last = torch.tensor([[prompts[0][-1]], [prompts[1][-1]]])
    together, _ = model(last, torch.tensor([4, 1]), cache)
    torch.testing.assert_close(together[:, 0], torch.stack(alone))


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    save_tiny_hf(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_target(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_tiny_hf(tmp_path, "llama")
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_target(tmp_path)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    save_tiny_hf(tmp_path, "llama")
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(31)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm.weight has shape \(31,\)"):
        load_target(tmp_path)


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_target(tmp_path)


def test_parameter_count_matches_module() -> None:
    model = tiny_target()
    assert TINY.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_attention_of_a_few_queries_equals_torchs_grouped_query_attention(dtype: torch.dtype, masked: bool) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, length, keys, dim = 3, 6, 2, 4, 11, 8
    q = torch.randn(batch, heads, length, dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, dim, dtype=dtype)
    mask = None
    if masked:  # rows at their own positions, as a decoding step with rows of different lengths
        positions = torch.tensor([[3], [7], [10]]) - (length - 1) + torch.arange(length)
        mask = (torch.arange(keys) <= positions[:, :, None])[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(attend_few(q, k, v, mask), expected, atol=tolerance, rtol=tolerance)
