"""A feature drafter's layer in one C call: the torch path's outputs and cache writes, and the torch
path wherever the C call cannot serve."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model import packed_linear, row_kernel
from specd.model.fused_layer import c_positions
from specd.testing import tiny_target


@pytest.fixture
def kernel() -> row_kernel.RowKernel:
    built = row_kernel.row_kernel()
    if built is None or built.layer is None:
        pytest.fail("the few-row kernel did not build on this machine (a C compiler is part of the set-up)")
    return built


def loud_drafter(seed: int = 0) -> tuple[torch.nn.Module, FeatureDrafterModel]:
    """A float32 tiny target and a drafter whose random weights move every output."""
    target = tiny_target(dtype=torch.float32).eval()
    drafter = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                  torch.arange(target.config.vocab_size)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if param.dim() > 1 else 1.0))
    return target, drafter


def step_both_ways(drafter: FeatureDrafterModel, monkeypatch: pytest.MonkeyPatch, batch: int, length: int,
                   starts: list[int], first_slot: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One `step` through the C call and through torch, from the same cache contents; both outputs
    and the differences of the caches after."""
    generator = torch.Generator().manual_seed(batch * 10 + length)
    caches = [drafter.new_cache(first_slot + batch + 1, 64) for _ in range(2)]
    for name in ("k", "v"):
        noise = torch.randn(getattr(caches[0], name).shape, generator=generator)
        for cache in caches:
            getattr(cache, name).copy_(noise)
    state = torch.randn(batch, length, drafter.config.hidden_size, generator=generator) * 3
    tokens = torch.randint(0, drafter.config.vocab_size, (batch, length), generator=generator)
    start = torch.tensor(starts)
    with torch.inference_mode():
        fused = drafter.step(state, tokens, start, caches[0], first_slot=first_slot)
        monkeypatch.setenv("SPECD_FUSED_LAYER", "0")
        plain = drafter.step(state, tokens, start, caches[1], first_slot=first_slot)
        monkeypatch.delenv("SPECD_FUSED_LAYER")
    return fused, plain, [caches[0].k - caches[1].k, caches[0].v - caches[1].v]


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("batch, length, starts, first_slot", [
    (1, 1, [40], 0), (1, 5, [0], 0), (2, 3, [9, 30], 1), (3, 1, [5, 50, 0], 0), (4, 3, [1, 2, 3, 4], 2)])
def test_the_c_layer_gives_the_torch_paths_outputs_and_cache_writes(
        kernel: row_kernel.RowKernel, monkeypatch: pytest.MonkeyPatch, half: bool, batch: int, length: int,
        starts: list[int], first_slot: int) -> None:
    monkeypatch.setattr(packed_linear, "_HALF_WEIGHTS", half)
    _, drafter = loud_drafter()
    fused, plain, cache_differences = step_both_ways(drafter, monkeypatch, batch, length, starts, first_slot)
    assert fused.abs().max() > 1  # loud outputs: a wrong cache entry or rotation would show
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    assert all(float(d.abs().max()) < 1e-5 for d in cache_differences)  # the same positions, the same values


def test_a_drafting_step_does_not_reach_torchs_attention_where_the_c_layer_serves(
        kernel: row_kernel.RowKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    _, drafter = loud_drafter()

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch's attention ran")

    monkeypatch.setattr(drafter.attn, "forward", refuse)
    cache = drafter.new_cache(1, 16)
    with torch.inference_mode():
        out = drafter.step(torch.randn(1, 2, drafter.config.hidden_size), torch.tensor([[1, 2]]), torch.tensor([3]),
                           cache)
    assert out.shape == (1, 2, drafter.config.hidden_size)


def call_layer(drafter: FeatureDrafterModel, positions: torch.Tensor, tokens: torch.Tensor,
               cache_len: int = 16) -> torch.Tensor | None:
    cache = drafter.new_cache(positions.shape[0], cache_len)
    state = torch.randn(*tokens.shape, drafter.config.hidden_size)
    rope = drafter.rope(cache.max_seq)
    where = c_positions(positions, cache.max_seq, rope)
    return None if where is None else drafter._fused(state, where, cache.k[0], cache.v[0], rope, drafter.embedding,
                                                     tokens)


def test_the_c_layer_stands_aside_where_it_cannot_serve(kernel: row_kernel.RowKernel,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _, drafter = loud_drafter()
    ok = torch.tensor([[2, 3]]), torch.tensor([[1, 2]])
    with torch.inference_mode():
        assert call_layer(drafter, *ok) is not None
        assert call_layer(drafter, torch.tensor([[15, 16]]), ok[1]) is None  # past the cache
        assert call_layer(drafter, ok[0], torch.tensor([[1, drafter.config.vocab_size]])) is None  # past the vocabulary
        rows = packed_linear.KERNEL_MAX_ROWS + 1
        assert call_layer(drafter, torch.arange(rows)[None], torch.ones(1, rows, dtype=torch.long), rows + 8) is None
        monkeypatch.setenv("SPECD_FUSED_LAYER", "0")
        assert call_layer(drafter, *ok) is None
        monkeypatch.delenv("SPECD_FUSED_LAYER")
        torch.set_num_threads(2)
        try:
            assert call_layer(drafter, *ok) is None  # the kernel serves one thread only
        finally:
            torch.set_num_threads(1)
    assert call_layer(drafter, *ok) is None  # a gradient may be wanted: training keeps torch's path
    # past the cache, the torch path raises rather than writing out of bounds
    with torch.inference_mode(), pytest.raises(IndexError):
        drafter.step(torch.randn(1, 1, drafter.config.hidden_size), torch.tensor([[1]]), torch.tensor([16]),
                     drafter.new_cache(1, 16))


def test_greedy_decoding_through_the_c_layer_is_the_targets_own(kernel: row_kernel.RowKernel) -> None:
    target, drafter = loud_drafter(seed=3)
    prompts = [[(5 * i + 2 * j) % target.config.vocab_size for j in range(3 + 2 * i)] for i in range(5)]

    def decode(draft_model: FeatureDrafterModel | None) -> list[list[int]]:
        engine = Engine(target, FeatureDrafter(draft_model) if draft_model is not None else None,
                        EngineConfig(max_batch=3, num_draft_tokens=3, adaptive_lookahead=False))
        seqs = [engine.add_request(prompt, SamplingParams(max_tokens=16)) for prompt in prompts]
        while engine.has_work:
            engine.step()
        return [seq.output_ids for seq in seqs]

    assert decode(drafter) == decode(None)


def target_pass(target: torch.nn.Module, cache: object, tokens: torch.Tensor, start: list[int],
                first_slot: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        logits, _ = target(tokens, torch.tensor(start), cache, first_slot=first_slot, logits_for="all")
    return logits


def prefilled(target: torch.nn.Module, slots: int, length: int = 20, seed: int = 0) -> object:
    cache = target.new_cache(slots, 64)
    prompt = torch.randint(0, target.config.vocab_size, (slots, length), generator=torch.Generator().manual_seed(seed))
    with mock.patch.object(packed_linear, "KERNEL_MAX_ROWS", 0):  # torch's path, in every setting alike
        target_pass(target, cache, prompt, [0] * slots)
    return cache


def test_a_targets_pass_through_the_c_layers_gives_torchs_logits_and_cache(
        kernel: row_kernel.RowKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target(dtype=torch.float32).eval()
    tokens = torch.randint(0, target.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(1))
    fused_cache, plain_cache = prefilled(target, 4), prefilled(target, 4)
    fused = target_pass(target, fused_cache, tokens, [20, 17, 9], first_slot=1)
    monkeypatch.setenv("SPECD_FUSED_LAYER", "0")
    plain = target_pass(target, plain_cache, tokens, [20, 17, 9], first_slot=1)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    # the first layer's keys and values as torch writes them; later layers' to float32 rounding
    for name in ("k", "v"):
        fused_entries, plain_entries = getattr(fused_cache, name), getattr(plain_cache, name)
        torch.testing.assert_close(fused_entries[0], plain_entries[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_entries, plain_entries, rtol=1e-4, atol=1e-5)


def test_a_targets_row_has_the_same_bits_alone_and_beside_other_rows_and_positions(
        kernel: row_kernel.RowKernel) -> None:
    """What keeps greedy speculation lossless: a decoding step's row and the same row in a
    verification pass (more positions) or beside other requests (more rows) agree to the bit."""
    target = tiny_target(dtype=torch.float32).eval()
    tokens = torch.randint(0, target.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    alone = target_pass(target, prefilled(target, 1), tokens[:1, :1], [20])
    with_positions = target_pass(target, prefilled(target, 1), tokens[:1], [20])
    beside_rows = target_pass(target, prefilled(target, 3), tokens[:, :1], [20, 20, 20])
    assert torch.equal(with_positions[0, 0], alone[0, 0])
    assert torch.equal(beside_rows[0, 0], alone[0, 0])
