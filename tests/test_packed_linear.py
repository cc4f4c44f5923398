"""PackedLinear: inference through prepared layouts (the few-row kernel, MKL's, oneDNN's) that matches
nn.Linear and never serves a stale weight."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.model import packed_linear
from specd.model.packed_linear import PackedLinear, prepare_layouts
from specd.testing import tiny_target

needs_onednn = pytest.mark.skipif(not packed_linear.packing_enabled(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True, params=["few-row kernel", "torch's products"])
def paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with the few-row kernel where it serves (one thread, as here) and without it."""
    if request.param == "torch's products":
        monkeypatch.setattr(packed_linear, "KERNEL_MAX_ROWS", 0)


def _layer(seed: int = 0, bias: bool = False) -> PackedLinear:
    torch.manual_seed(seed)
    return PackedLinear(48, 80, bias=bias)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (3, 48), (4, 5, 48), (1, 2, 48), (2, 1, 48)])
def test_inference_matches_nn_linear_for_every_row_count(shape: tuple[int, ...]) -> None:
    layer = _layer(bias=True)
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = layer(x)
    assert layer._layouts, "no prepared layout was used"
    assert out.shape == (*shape[:-1], 80)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_non_contiguous_input_is_multiplied_correctly() -> None:
    layer = _layer()
    x = torch.randn(3, 6, 48)[:, 1:4]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4])  # the transposed copy and the packed one
def test_an_in_place_weight_write_is_served_at_once(rows: int) -> None:
    layer, x = _layer(), torch.randn(rows, 48)
    with torch.no_grad():
        layer(x)
        layer.weight.copy_(torch.randn(80, 48))  # what a hot swap or an optimizer step does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4])
def test_a_replaced_weight_tensor_is_served_at_once(rows: int) -> None:
    layer, x = _layer(), torch.randn(rows, 48)
    with torch.no_grad():
        layer(x)
        layer.weight = torch.nn.Parameter(torch.randn(80, 48))  # what tying embeddings does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_training_takes_gradients_through_the_plain_product() -> None:
    layer, x = _layer(), torch.randn(4, 48, requires_grad=True)
    layer(x).square().sum().backward()
    reference = _layer()
    x_ref = x.detach().clone().requires_grad_(True)
    F.linear(x_ref, reference.weight).square().sum().backward()
    assert not layer._layouts
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_frozen_layer_still_passes_gradients_to_its_input() -> None:
    layer = _layer().requires_grad_(False)
    x = torch.randn(4, 48, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 48))


@needs_onednn
def test_a_packed_layer_can_be_copied_and_pickled() -> None:
    layer, x = _layer(), torch.randn(4, 48)
    with torch.no_grad():
        layer(x[:1])
        expected = layer(x)
        copied = copy.deepcopy(layer)
        unpickled = pickle.loads(pickle.dumps(layer))
        torch.testing.assert_close(copied(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unpickled(x), expected, rtol=1e-5, atol=1e-5)
    assert set(layer.state_dict()) == {"weight"}


def test_packing_switched_off_uses_the_plain_product(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "_PACKING", False)
    layer, x = _layer(), torch.randn(4, 48)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert not layer._layouts


def test_the_environment_switch_turns_packing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_PACKED_LINEAR", "0")
    assert not packed_linear.packing_enabled()


@needs_onednn
def test_prepared_layouts_are_the_ones_inference_then_uses() -> None:
    model = torch.nn.Sequential(_layer(), torch.nn.ReLU(), PackedLinear(80, 16))
    prepare_layouts(model)
    made = {id(layer): {name: entry[3] for name, entry in (layer._layouts or {}).items()}
            for layer in model if isinstance(layer, PackedLinear)}
    one_row = "panels" if packed_linear.kernel_rows(1) is not None else "transposed"
    assert all(set(layouts) == {one_row, "packed"} for layouts in made.values())
    with torch.inference_mode():
        model(torch.randn(1, 48))
        model(torch.randn(4, 48))
    for layer in model:
        if isinstance(layer, PackedLinear):
            assert layer._layouts is not None
            assert all(layer._layouts[name][3] is copy for name, copy in made[id(layer)].items())


@needs_onednn
def test_a_swapped_in_version_is_prepared_on_the_offering_thread() -> None:
    target = tiny_target(dtype=torch.float32)
    first, second = (new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                         torch.arange(target.config.vocab_size), seed=seed) for seed in (0, 1))
    drafter = FeatureDrafter(first, version=1)
    drafter.offer(second, version=2)
    assert all(layer._layouts for layer in second.modules() if isinstance(layer, PackedLinear))


@needs_onednn
def test_preparing_at_another_thread_count_keeps_only_the_copies_that_count_uses() -> None:
    """A server pinned to one core after its engine was built at two must not hold the two-thread copies."""
    layer, threads = _layer(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        layer.prepare()
        assert set(layer._layouts or {}) == {"transposed", "packed"}
        torch.set_num_threads(1)
        layer.prepare()
        few_rows = "panels" if packed_linear.kernel_rows(1) is not None else "transposed"
        assert set(layer._layouts or {}) == {few_rows, "packed"}
        with torch.inference_mode():
            torch.testing.assert_close(layer(torch.ones(1, 48)), F.linear(torch.ones(1, 48), layer.weight))
    finally:
        torch.set_num_threads(threads)


@needs_onednn
def test_starting_a_learner_process_leaves_the_shared_targets_layouts_ready(tmp_path: Path) -> None:
    """A learner process shares the server's target weights, which moves them into shared memory;
    the layouts an engine made before are remade then, not on the server's next pass."""
    from specd.learner.config import LearnerConfig
    from specd.learner.process import LearnerProcess
    from specd.model.fingerprint import TargetFingerprint

    target = tiny_target(dtype=torch.float32)
    prepare_layouts(target)  # as an engine built before the learner started does
    layers = [m for m in target.modules() if isinstance(m, PackedLinear)]
    before = [layer.weight.data_ptr() for layer in layers]
    LearnerProcess(LearnerConfig(), tmp_path, target, TargetFingerprint.of(target.config), torch.float32, [0])
    assert [layer.weight.data_ptr() for layer in layers] != before, "sharing did not move the weights"
    for layer in layers:
        assert layer._layouts and all(cached[2] == layer.weight.data_ptr() for cached in layer._layouts.values())
