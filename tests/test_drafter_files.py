"""Untrusted drafter files: a doctored config is refused by its header and a meta-device skeleton,
before any tensor is read or any model is allocated."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file, save_file

from specd.core.errors import CheckpointError
from specd.drafter.checkpoint import MAX_POSITION, load_drafter, read_metadata, save_drafter
from specd.drafter.feature_model import new_feature_drafter
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer

SHAPE = DrafterShape(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
FINGERPRINT = TargetFingerprint(96, "none")


def saved(tmp_path: Path, kind: str) -> Path:
    target = tiny_target()
    path = tmp_path / f"{kind}.safetensors"
    if kind == "token":
        save_drafter(new_drafter_model(target, SHAPE), path, FINGERPRINT)
    else:
        model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                    torch.arange(64))
        save_drafter(model, path, FINGERPRINT)
    return path


def doctored(path: Path, **changes: Any) -> Path:
    """The same tensors under a config with `changes` applied."""
    metadata = read_metadata(path)
    key = "model_config" if "model_config" in metadata else "feature_config"
    metadata[key] = json.dumps({**json.loads(metadata[key]), **changes})
    out = path.with_name("doctored-" + path.name)
    save_file(load_file(str(path)), str(out), metadata=metadata)
    return out


DOCTORED = {  # (kind, config changes, what the refusal names)
    "a million layers": ("token", {"num_layers": 1_000_000}, "layers"),
    "a huge width": ("token", {"hidden_size": 1 << 20, "head_dim": 1 << 18}, "shape"),
    "a huge vocabulary": ("token", {"vocab_size": 1 << 30}, "shape|fingerprint|target"),
    "huge rotary tables": ("token", {"max_position": 1 << 40}, "max_position"),
    "a huge feature width": ("feature", {"intermediate_size": 1 << 28}, "shape"),
    "feature rotary tables": ("feature", {"max_position": MAX_POSITION + 1}, "max_position"),
}


@pytest.mark.parametrize("case", sorted(DOCTORED))
def test_a_doctored_config_is_refused_before_anything_is_allocated(tmp_path: Path, case: str) -> None:
    kind, changes, needle = DOCTORED[case]
    target = tiny_target()
    path = doctored(saved(tmp_path, kind), **changes)
    with torch.device("meta"):  # torch's meta kernels load on first use (~140 MB, once a process): not ours
        Transformer(target.config)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=needle):
        load_drafter(path, FINGERPRINT, target_embedding=target.embed.weight)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 64  # what the config asked for is gigabytes to terabytes


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_an_honest_file_still_loads(tmp_path: Path, kind: str) -> None:
    target = tiny_target()
    model = load_drafter(saved(tmp_path, kind), FINGERPRINT, target_embedding=target.embed.weight)
    assert all(p.device.type == "cpu" and bool(torch.isfinite(p).all()) for p in model.parameters())
