"""The few-row kernel: products equal to torch's, a row's bits independent of the other rows, and a
quiet fallback to torch's paths wherever it cannot be built."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specd.core.provenance import cpuinfo_line
from specd.model import packed_linear, row_kernel
from specd.model.packed_linear import PackedLinear, prepare_layouts
from specd.testing import tiny_target


@pytest.fixture
def kernel() -> row_kernel.RowKernel:
    built = row_kernel.row_kernel()
    if built is None:
        pytest.fail("the few-row kernel did not build on this machine (a C compiler is part of the set-up)")
    return built


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """`row_kernel()` forgets what it loaded and builds into an empty cache folder."""
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    row_kernel.row_kernel.cache_clear()
    yield tmp_path / "kernels"
    row_kernel.row_kernel.cache_clear()


@pytest.mark.parametrize("out_features, in_features", [(80, 48), (50, 33), (16, 7), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 30])
def test_products_match_torchs_for_any_rows_and_shape(kernel: row_kernel.RowKernel, rows: int, out_features: int,
                                                       in_features: int) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    out = kernel.linear(x, kernel.panels(weight), out_features)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["float32", "fp16"])
def test_a_rows_bits_do_not_depend_on_the_other_rows(kernel: row_kernel.RowKernel, layout: str) -> None:
    if layout == "fp16" and not kernel.has_half:
        pytest.skip("this CPU converts no fp16 (no F16C): drafters keep float32 panels")
    torch.manual_seed(0)
    weight, x = torch.randn(200, 96), torch.randn(29, 96)
    panels = kernel.panels(weight) if layout == "float32" else kernel.half_panels(weight)
    together = kernel.linear(x, panels, 200)
    for rows in range(1, 29):
        assert torch.equal(kernel.linear(x[:rows], panels, 200), together[:rows])
    for row in (0, 11, 12, 28):  # alone, as in a one-token decoding step
        assert torch.equal(kernel.linear(x[row:row + 1], panels, 200), together[row:row + 1])


def _fused_in_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each output summed over the inputs in order, a fused multiply-add each: the product of two
    float32 is exact in float64, so one rounding to float32 a step (bar a double rounding of the sum,
    about one in 2^29)."""
    sums = np.zeros((x.shape[0], weight.shape[0]), dtype=np.float32)
    xs, ws = x.double().numpy(), weight.double().numpy()
    for k in range(x.shape[1]):
        sums = (xs[:, k:k + 1] * ws[:, k] + sums.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(sums)


@pytest.mark.skipif(" fma" not in f" {cpuinfo_line('flags') or ''}", reason="no fused multiply-add on this CPU")
@pytest.mark.parametrize("rows", list(range(1, 14)))
def test_every_block_shape_sums_each_output_in_order_with_fused_multiply_adds(kernel: row_kernel.RowKernel,
                                                                               rows: int) -> None:
    # 200 outputs leave panels outside whole blocks, summed one panel at a time (a compiler tuned for
    # Zen once left that single chain as a multiply and an add, rounding twice)
    torch.manual_seed(rows)
    weight, x = torch.randn(200, 96), torch.randn(rows, 96)
    assert torch.equal(kernel.linear(x, kernel.panels(weight), 200), _fused_in_order(x, weight))


def test_panels_are_the_kernels_vector_wide_and_remade_for_a_kernel_of_another_width(
        kernel: row_kernel.RowKernel) -> None:
    layer = PackedLinear(48, 80, bias=False)
    assert layer.kernel_panels(kernel).shape == (80 // kernel.panel_width, 48, kernel.panel_width)
    other = copy.copy(kernel)  # as a benchmark's earlier kernel of another width
    other.panel_width = 16 if kernel.panel_width != 16 else 8
    assert layer.kernel_panels(other).shape[-1] == other.panel_width
    assert layer.kernel_panels(kernel).shape[-1] == kernel.panel_width


def test_a_build_narrower_than_avx512_keeps_the_avx2_reach_whatever_the_cpus_flags(
        kernel: row_kernel.RowKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    narrow, wide = copy.copy(kernel), copy.copy(kernel)
    narrow.panel_width, wide.panel_width = 8, 16  # a $CC without AVX-512, and the build with it
    monkeypatch.setattr(packed_linear, "KERNEL_MAX_ROWS", 48)  # as on an Intel CPU with AVX-512
    assert packed_linear.kernel_reach(wide) == 48
    assert packed_linear.kernel_reach(narrow) == packed_linear.NARROW_BUILD_ROWS == 12
    with mock.patch.object(packed_linear, "row_kernel", return_value=narrow):  # on one thread (conftest)
        assert packed_linear.kernel_rows(12) is narrow
        assert packed_linear.kernel_rows(13) is None
    with mock.patch.object(packed_linear, "row_kernel", return_value=wide):
        assert packed_linear.kernel_rows(48) is wide


def test_leading_dimensions_and_non_contiguous_inputs_keep_their_shape(kernel: row_kernel.RowKernel) -> None:
    weight, x = torch.randn(40, 24), torch.randn(3, 7, 24)[:, 1:5]
    out = kernel.linear(x, kernel.panels(weight), 40)
    assert out.shape == (3, 4, 40)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_the_library_is_built_once_and_found_again(fresh_build: Path) -> None:
    assert row_kernel.row_kernel() is not None
    built = list(fresh_build.glob("row_kernel-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    row_kernel.row_kernel.cache_clear()
    assert row_kernel.row_kernel() is not None
    assert [path.stat().st_mtime_ns for path in fresh_build.glob("row_kernel-*.so")] == [stamp]


def test_a_failed_build_leaves_torchs_paths_and_says_why(fresh_build: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING):
        assert row_kernel.row_kernel() is None
    assert "few-row kernel is unavailable" in caplog.text
    assert not list(fresh_build.glob("*.so"))
    layer, x = PackedLinear(48, 80, bias=False), torch.randn(3, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer._layouts is not None and "panels" not in layer._layouts


def test_the_environment_switch_turns_the_kernel_off(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_ROW_KERNEL", "0")
    assert row_kernel.row_kernel() is None
    assert not list(fresh_build.glob("*.so"))


@pytest.mark.skipif(not packed_linear.packing_enabled(), reason="this torch has no oneDNN")
def test_on_one_thread_a_target_is_prepared_for_the_kernel_and_multiplies_through_it(
        kernel: row_kernel.RowKernel) -> None:
    model = tiny_target(dtype=torch.float32).eval()
    prepare_layouts(model)
    layers = [layer for layer in model.modules() if isinstance(layer, PackedLinear)]
    assert all(set(layer._layouts or {}) == {"panels", "packed"} for layer in layers)
    tokens = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        logits, _ = model(tokens, torch.zeros(1, dtype=torch.long), cache, logits_for="all")
        with mock.patch.object(packed_linear, "KERNEL_MAX_ROWS", 0):
            without, _ = model(tokens, torch.zeros(1, dtype=torch.long), cache, logits_for="all")
    torch.testing.assert_close(logits, without, rtol=1e-4, atol=1e-4)
    assert all(set(layer._layouts or {}) == {"panels", "packed"} for layer in layers), "a layout was made late"
