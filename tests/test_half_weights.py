"""A drafter's weights in fp16 through the few-row kernel: exactly the products of the rounded
weights, targets never rounded, drafts of fp16-held weights unchanged (a row's bits independent of
the other rows: tests/test_row_kernel.py, in both layouts)."""

from __future__ import annotations

import pytest
import torch

from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model import packed_linear, row_kernel
from specd.model.packed_linear import PackedLinear, prepare_layouts
from specd.testing import tiny_target


@pytest.fixture
def kernel() -> row_kernel.RowKernel:
    built = row_kernel.row_kernel()
    if built is None:
        pytest.fail("the few-row kernel did not build on this machine (a C compiler is part of the set-up)")
    if not built.has_half:
        pytest.skip("this CPU converts no fp16 (no F16C): drafters keep float32 panels")
    return built


def rounded(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.float16).to(torch.float32)


@pytest.mark.parametrize("out_features, in_features", [(80, 48), (50, 33), (16, 7), (960, 1152)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 12, 13])
def test_fp16_panels_give_exactly_the_products_of_the_weights_rounded_to_fp16(
        kernel: row_kernel.RowKernel, rows: int, out_features: int, in_features: int) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features) * 0.1, torch.randn(rows, in_features)
    half = kernel.half_panels(weight)
    assert half.dtype == torch.float16
    out = kernel.linear(x, half, out_features)
    assert torch.equal(out, kernel.linear(x, kernel.panels(rounded(weight)), out_features))
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-2, atol=1e-2)  # rounding, nothing more


@pytest.mark.parametrize("bad", [1e5, float("inf"), float("nan")])
def test_a_weight_outside_fp16s_range_keeps_float32_panels(kernel: row_kernel.RowKernel, bad: float) -> None:
    weight = torch.randn(32, 16)
    weight[3, 5] = bad
    panels = kernel.half_panels(weight)
    assert panels.dtype == torch.float32
    torch.testing.assert_close(panels, kernel.panels(weight), rtol=0, atol=0, equal_nan=True)


def drafter_and_target() -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_target(dtype=torch.float32).eval()
    drafter = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                  torch.arange(target.config.vocab_size)).eval()
    return target, drafter


@pytest.mark.skipif(not packed_linear.packing_enabled(), reason="this torch has no oneDNN")
def test_a_drafters_layers_are_prepared_in_fp16_and_a_targets_never_are(kernel: row_kernel.RowKernel) -> None:
    target, drafter = drafter_and_target()
    prepare_layouts(target)
    prepare_layouts(drafter)
    target_layers = [m for m in target.modules() if isinstance(m, PackedLinear)]
    drafter_layers = [m for m in drafter.modules() if isinstance(m, PackedLinear)]
    assert all(set(m._layouts or {}) == {"panels", "packed"} for m in target_layers)
    assert all(set(m._layouts or {}) == {"half_panels", "packed"} for m in drafter_layers)
    assert all(m._layouts is not None and m._layouts["half_panels"][3].dtype == torch.float16 for m in drafter_layers)


def test_the_switch_keeps_a_drafters_layers_in_float32(kernel: row_kernel.RowKernel,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "_HALF_WEIGHTS", False)
    _, drafter = drafter_and_target()
    prepare_layouts(drafter)
    assert all("panels" in (m._layouts or {}) and "half_panels" not in (m._layouts or {})
               for m in drafter.modules() if isinstance(m, PackedLinear))


def drafts(drafter_model: torch.nn.Module, target: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Every draft a feature drafter proposes while an engine decodes the prompts greedily at k = 4."""
    engine = Engine(target, FeatureDrafter(drafter_model), EngineConfig(max_batch=2, num_draft_tokens=4,
                                                                                 adaptive_lookahead=False))
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=12)) for prompt in prompts]
    while engine.has_work:
        engine.step()
    return [list(step.drafts) for seq in seqs for step in seq.steps]


def test_drafts_of_fp16_held_weights_are_the_same_through_fp16_panels(kernel: row_kernel.RowKernel,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = drafter_and_target()
    with torch.no_grad():  # as the shipped file holds them: every weight exactly an fp16 value
        for param in drafter.parameters():
            param.copy_(rounded(param))
    prompts = [[(7 * i + 3 * j) % target.config.vocab_size for j in range(5 + i)] for i in range(6)]
    in_half = drafts(drafter, target, prompts)
    assert all(m._layouts is not None and m._layouts["half_panels"][3].dtype == torch.float16
               for m in drafter.modules() if isinstance(m, PackedLinear)), "the drafts did not come through fp16"
    monkeypatch.setattr(packed_linear, "_HALF_WEIGHTS", False)
    in_float32 = drafts(drafter.clone(), target, prompts)
    assert sum(map(len, in_half)) > 20 and in_float32 == in_half
