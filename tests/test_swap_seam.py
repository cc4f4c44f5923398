"""The one swap seam (`specd.drafter.swap`) and the one check of a version's file
(`specd.hotswap.integrity`): every drafter the swapper serves takes weights the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.core.errors import BadWeights, CheckpointError, StoreError
from specd.drafter.factory import DrafterSpec, build_drafter
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.drafter.swap import ServingDrafter, Swappable
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.hotswap.integrity import check_file, load_verified
from specd.hotswap.store import WeightStore
from specd.model.fingerprint import TargetFingerprint
from specd.testing import TINY, tiny_target

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def test_every_serving_drafter_is_swappable() -> None:
    model = new_drafter_model(tiny_target(), SHAPE)
    for kind in ("learned", "hybrid"):
        drafter = build_drafter(DrafterSpec(kind=kind), model, "1")
        assert isinstance(drafter, ServingDrafter) and isinstance(drafter, Swappable)


def test_a_later_offer_replaces_one_not_yet_taken_and_installs_once() -> None:
    target = tiny_target()
    drafter = TokenDrafter(new_drafter_model(target, SHAPE), 1)
    second, third = new_drafter_model(target, SHAPE, seed=2), new_drafter_model(target, SHAPE, seed=3)
    drafter.offer(second, 2)
    drafter.offer(third, 3)
    assert drafter.version == 1             # nothing changes until the serving thread takes it
    assert drafter.apply_pending() is True
    assert drafter.model is third and drafter.version == 3 and drafter.num_swaps == 1
    assert drafter.apply_pending() is False   # taken once


def test_weights_of_another_kind_are_refused_at_the_offer() -> None:
    target = tiny_target().float()
    token = new_drafter_model(target, SHAPE)
    feature = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                  torch.arange(40))
    with pytest.raises(BadWeights, match="serves FeatureDrafterModel weights, not Transformer"):
        FeatureDrafter(feature, "1").offer(token, "2")
    with pytest.raises(BadWeights, match="serves Transformer weights, not FeatureDrafterModel"):
        TokenDrafter(token, "1").offer(feature, "2")


def test_a_file_that_differs_from_its_manifest_is_refused_by_the_store_and_by_a_swap(tmp_path: Path) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    version = store.publish(new_drafter_model(target, SHAPE), FINGERPRINT, None, {})
    path, manifest = store.weights_path(version), store.manifest(version)
    serving = TokenDrafter(new_drafter_model(target, SHAPE), "0")
    assert load_verified(version, path, manifest, FINGERPRINT, serving) is not None
    with path.open("r+b") as handle:  # one byte flipped on disk
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    with pytest.raises(StoreError, match="does not match the manifest"):
        check_file(version, path, manifest, StoreError)
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        load_verified(version, path, manifest, FINGERPRINT, serving)
    assert torch.equal(next(serving.model.parameters()), next(serving.model.parameters()))  # serving untouched
