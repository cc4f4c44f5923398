"""`specd pretrain` and the day-0 feature drafter.

The offline pipeline writes a loadable fp16 feature drafter and a manifest, and resumes from its
work folder without recomputing what it already has. A pretrained file that does not fit the
target, or is corrupt, never stops a server: it is refused with a warning and the drafter starts
from scratch. `load_drafter` refuses a feature drafter file with tampered draft ids or weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import specd.offline.corpus as pretrain_data
import specd.offline.training_loop as training_loop
from specd.core.errors import CheckpointError, ConfigurationError
from specd.drafter.checkpoint import load_drafter, read_metadata, save_drafter
from specd.drafter.feature_model import FeatureDrafterModel, init_from_target_layer, new_feature_drafter
from specd.drafter.pretrained import SHIPPED_DRAFTER, check_manifest, day0_feature_model
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import ModelConfig, Transformer
from specd.offline.distill import DistillConfig
from specd.offline.pretrain import RECIPE_PARENTS, RECIPES, PretrainConfig, config_from_settings, pretrain
from specd.testing import TINY, tiny_loaded_target, tiny_target

TINY_PRETRAIN = PretrainConfig(data="sharegpt", conversations=4, max_length=48, steps=4, batch_size=2, eval_prompts=2,
                               eval_tokens=6, eval_every=2, checkpoint_every=2, shard_size=2,
                               distill=DistillConfig(dtype="float32"))
COMMAND = "specd pretrain --conversations 4 --steps 4 (test)"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Any]:
    """One tiny pretraining run: the loaded target, its work folder, the version file and manifest."""
    root = tmp_path_factory.mktemp("pretrain")
    loaded = tiny_loaded_target()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # runs before the per-test one-thread fixture: tiny models, one thread
    try:
        manifest = pretrain(loaded, TINY_PRETRAIN, root / "work", root / "drafter.safetensors", COMMAND)
    finally:
        torch.set_num_threads(threads)
    return {"loaded": loaded, "root": root, "work": root / "work", "out": root / "drafter.safetensors",
            "manifest": manifest}


def test_pretrain_writes_a_loadable_fp16_drafter_and_its_manifest(pretrained) -> None:
    loaded, out, work = pretrained["loaded"], pretrained["out"], pretrained["work"]
    model = load_drafter(out, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    assert isinstance(model, FeatureDrafterModel)
    assert model.config.hidden_size == loaded.model.config.hidden_size
    # the file holds the trained weights (the last checkpoint), in fp16, and the corpus's draft vocabulary
    trained = load_file(str(work / "train-state.safetensors"))
    with safe_open(str(out), framework="pt") as handle:
        assert {handle.get_tensor(name).dtype for name in handle.keys() if name != "draft_ids"} == {torch.float16}  # noqa: SIM118
    for name, tensor in model.state_dict().items():
        expected = trained[name] if name == "draft_ids" else trained[name].half().float()
        assert torch.equal(tensor, expected), name
    assert torch.equal(model.draft_ids, load_file(str(work / "data.safetensors"))["draft_ids"])

    manifest = pretrained["manifest"]
    assert json.loads(read_metadata(out)["manifest"]) == manifest
    assert manifest["command"] == COMMAND and manifest["seed"] == TINY_PRETRAIN.seed
    assert manifest["steps"] == 4 and manifest["tokens_trained"] > 0
    assert manifest["data"]["examples"] == 4 and manifest["data"]["conversations"] == "6000-9399"
    assert 4 * 16 <= manifest["data"]["tokens"] <= 4 * TINY_PRETRAIN.max_length
    assert "sharegpt" in manifest["data"]["source"].lower()
    assert len(manifest["data"]["sha256"]) == 64
    held_out = manifest["held_out"]
    assert held_out["k"] == TINY_PRETRAIN.eval_k
    for name in ("validation", "evaluation"):
        assert held_out[name]["prompts"] == 2 and len(held_out[name]["sha256"]) == 64
        assert 1.0 <= held_out[name]["accept_length"] <= TINY_PRETRAIN.eval_k + 1
    assert held_out["validation"]["sha256"] != held_out["evaluation"]["sha256"]
    assert [point["step"] for point in manifest["curve"]] == [0, 2, 4]
    assert held_out["accept_length"] == manifest["curve"][-1]["evaluation_accept_length"]
    written = json.loads(out.with_suffix(".json").read_text())
    assert written.pop("file_sha256") == hashlib.sha256(out.read_bytes()).hexdigest()


def test_pretrain_resumes_from_its_checkpoint_without_recomputing_features(pretrained, tmp_path: Path,
                                                                          monkeypatch) -> None:
    work = tmp_path / "work"
    shutil.copytree(pretrained["work"], work)
    shards = sorted(work.glob("features-*.safetensors"))
    assert len(shards) == 2  # 4 conversations, 2 a shard
    stamps = {path: path.stat().st_mtime_ns for path in [*shards, work / "validation.safetensors",
                                                         work / "evaluation.safetensors", work / "data.safetensors"]}
    calls = {"features": 0, "loss": 0}
    real_loss = training_loop.feature_loss

    def counted_features(*args, **kwargs):
        calls["features"] += 1
        raise AssertionError("a resumed run recomputed target features")

    def counted_loss(*args, **kwargs):
        calls["loss"] += 1
        return real_loss(*args, **kwargs)

    def no_conversations():
        raise AssertionError("a resumed run re-read the conversations")

    monkeypatch.setattr(pretrain_data, "target_features", counted_features)
    monkeypatch.setattr(training_loop, "feature_loss", counted_loss)
    monkeypatch.setattr(pretrain_data, "iter_training_conversations", no_conversations)
    out = tmp_path / "drafter.safetensors"
    first = pretrained["manifest"]
    manifest = pretrain(pretrained["loaded"], replace(TINY_PRETRAIN, steps=6), work, out, COMMAND)
    assert calls == {"features": 0, "loss": 2}  # steps 5 and 6 only
    assert manifest["steps"] == 6 and manifest["tokens_trained"] > first["tokens_trained"]
    assert manifest["curve"][:3] == first["curve"]
    assert [point["step"] for point in manifest["curve"]] == [0, 2, 4, 6]
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
    assert json.loads((work / "progress.json").read_text())["step"] == 6
    loaded = pretrained["loaded"]
    model = load_drafter(out, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    assert isinstance(model, FeatureDrafterModel)
    # a budget below what the folder has trained is refused: the file would hold later weights than it says
    with pytest.raises(ConfigurationError, match="already trained 6 steps"):
        pretrain(pretrained["loaded"], replace(TINY_PRETRAIN, steps=4), work, tmp_path / "other.safetensors", COMMAND)


def test_pretrain_continues_a_version_file_from_its_weights_and_keeps_its_manifest_as_the_parent(
        pretrained, tmp_path: Path) -> None:
    loaded, first = pretrained["loaded"], pretrained["out"]
    out, work = tmp_path / "continued.safetensors", tmp_path / "work"
    # at learning rate 0 the continued file is its parent's weights: training started from them
    manifest = pretrain(loaded, replace(TINY_PRETRAIN, steps=2, learning_rate=0.0), work, out, COMMAND, parent=first)
    embedding = loaded.model.embed.weight
    before = load_drafter(first, loaded.fingerprint, target_embedding=embedding)
    after = load_drafter(out, loaded.fingerprint, target_embedding=embedding)
    assert before.state_dict().keys() == after.state_dict().keys()
    assert all(torch.equal(before.state_dict()[name], tensor) for name, tensor in after.state_dict().items())
    parent = manifest["parent"]
    assert parent["file_sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert parent["command"] == COMMAND and parent["held_out"] == pretrained["manifest"]["held_out"]
    assert "curve" not in parent  # the parent's file keeps its curve; the chain keeps its commands and figures
    assert manifest["settings"]["parent"] == parent["file_sha256"]
    assert check_manifest(out, required=True) == manifest

    # a work folder never resumes onto another start
    with pytest.raises(ConfigurationError, match="started with other settings"):
        pretrain(loaded, replace(TINY_PRETRAIN, steps=2), work, tmp_path / "other.safetensors", COMMAND)
    with pytest.raises(ConfigurationError, match="cannot continue from"):
        pretrain(loaded, TINY_PRETRAIN, tmp_path / "work2", tmp_path / "other.safetensors", COMMAND,
                 parent=tmp_path / "missing.safetensors")
    with pytest.raises(ConfigurationError, match="draft ids"):
        pretrain(loaded, replace(TINY_PRETRAIN, drafter_layers=2), tmp_path / "work3", tmp_path / "other.safetensors",
                 COMMAND, parent=first)


def test_keeping_the_best_writes_the_weights_of_the_best_validation_point_across_a_resume(
        pretrained, tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "work"
    shutil.copytree(pretrained["work"], work, ignore=shutil.ignore_patterns("train-state*", "optimizer*", "progress*",
                                                                             "curve*", "config.json"))
    # validation peaks at step 2 of 0, 2, 4, 6; evaluation (asked second at each point) never chooses
    validation = iter([1.5, 1.8, 1.7, 1.6])
    weights_at: dict[int, dict[str, torch.Tensor]] = {}
    asked = {"count": 0}

    def scripted(model, sequences, k) -> float:
        asked["count"] += 1
        if asked["count"] % 2 == 0:
            return 1.0
        weights_at[len(weights_at)] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        return next(validation)

    monkeypatch.setattr(training_loop, "held_out_accept_length", scripted)
    config = replace(TINY_PRETRAIN, keep="best", learning_rate=1e-2)
    loaded, out = pretrained["loaded"], tmp_path / "best.safetensors"
    pretrain(loaded, replace(config, steps=4), work, out, COMMAND)
    manifest = pretrain(loaded, replace(config, steps=6), work, out, COMMAND)  # resumed: step 2's weights reloaded
    assert manifest["steps"] == 6 and manifest["kept_step"] == 2
    assert manifest["held_out"]["validation"]["in_training"] == 1.8
    best = weights_at[1]
    assert not torch.equal(best["fc.weight"], weights_at[3]["fc.weight"])  # training moved on after it
    written = load_drafter(out, loaded.fingerprint, target_embedding=loaded.model.embed.weight).state_dict()
    assert written.keys() == best.keys()
    assert all(torch.equal(tensor, best[name].to(torch.float16).to(tensor.dtype)) for name, tensor in written.items())


# ---- the day-0 drafter: pretrained when it fits, from scratch otherwise ---------------------------

DRAFT_VOCAB = 64


@pytest.fixture
def target() -> Transformer:
    return tiny_target(dtype=torch.float32)


def fingerprint_of(target: Transformer) -> TargetFingerprint:
    return TargetFingerprint.of(target.config)


def trained_looking(target: Transformer, seed: int = 7) -> FeatureDrafterModel:
    """A drafter for `target` whose weights differ from a fresh one's (as a pretrained one would)."""
    model, _ = day0_feature_model(target, fingerprint_of(target), DRAFT_VOCAB, pretrained=None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    return model


def drafter_for(config: ModelConfig, seed: int = 0) -> FeatureDrafterModel:
    other = tiny_target(config, seed=seed, dtype=torch.float32)
    return new_feature_drafter(other.config, other.embed.weight, other.lm_head.weight, other.norm.weight,
                               torch.arange(DRAFT_VOCAB))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    first, second = a.state_dict(), b.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


def test_day0_uses_a_pretrained_file_made_for_this_target(target, tmp_path: Path) -> None:
    model = trained_looking(target)
    path = tmp_path / "pretrained.safetensors"
    save_drafter(model, path, fingerprint_of(target))
    day0, source = day0_feature_model(target, fingerprint_of(target), DRAFT_VOCAB, pretrained=path)
    assert source == "pretrained pretrained.safetensors"
    assert same_weights(day0, model)
    fresh, fresh_source = day0_feature_model(target, fingerprint_of(target), DRAFT_VOCAB, pretrained=None)
    assert fresh_source == "from scratch" and not same_weights(fresh, model)


def write_random_bytes(path: Path, target: Transformer) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(4096))


def write_other_fingerprint(path: Path, target: Transformer) -> None:
    save_drafter(trained_looking(target), path, TargetFingerprint(TINY.vocab_size, "another-tokenizer"))


def write_other_width(path: Path, target: Transformer) -> None:
    # same vocabulary, so the same fingerprint: only the width tells it apart
    save_drafter(drafter_for(replace(TINY, hidden_size=48, head_dim=12)), path, fingerprint_of(target))


def write_deeper_target(path: Path, target: Transformer) -> None:
    # same width and fingerprint, but it reads layers this 2-layer target does not have
    drafter = drafter_for(replace(TINY, num_layers=6))
    assert max(drafter.config.capture_layers) >= TINY.num_layers
    save_drafter(drafter, path, fingerprint_of(target))


def write_token_drafter(path: Path, target: Transformer) -> None:
    shape = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)
    save_drafter(new_drafter_model(target, shape), path, fingerprint_of(target))


def write_repeated_layer(path: Path, target: Transformer) -> None:
    # tensors of the right shapes, but a config reading layer 1 twice: the target captures it once,
    # so the features served would be narrower than the drafter reads
    save_drafter(trained_looking(target), path, fingerprint_of(target))
    retune(path, capture_layers=[1, 1])


UNFIT = {  # how the file is made, and what the warning must name
    "random bytes": (write_random_bytes, "not a readable safetensors file"),
    "empty file": (lambda path, target: path.write_bytes(b""), "not a readable safetensors file"),
    "missing file": (lambda path, target: None, "no such file"),
    "another target's fingerprint": (write_other_fingerprint, "made for target"),
    "another width": (write_other_width, "embedding has shape"),
    "layers the target lacks": (write_deeper_target, "reading layers"),
    "a token-level drafter": (write_token_drafter, "token-level"),
    "a repeated captured layer": (write_repeated_layer, "capture_layers"),
}


@pytest.mark.parametrize("case", list(UNFIT))
def test_day0_refuses_an_unfit_pretrained_file_with_a_warning_and_starts_from_scratch(
        case: str, target, tmp_path: Path, caplog) -> None:
    path = tmp_path / "pretrained.safetensors"
    write, reason = UNFIT[case]
    write(path, target)
    with caplog.at_level(logging.WARNING, logger="specd.drafter.pretrained"):
        model, source = day0_feature_model(target, fingerprint_of(target), DRAFT_VOCAB, pretrained=path)
    assert source == "from scratch"
    warnings = [r for r in caplog.records if r.name == "specd.drafter.pretrained" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "starting from scratch" in warnings[0].getMessage()
    assert str(path) in warnings[0].getMessage() and reason in warnings[0].getMessage()  # which file, and why
    fresh, _ = day0_feature_model(target, fingerprint_of(target), DRAFT_VOCAB, pretrained=None)
    assert isinstance(model, FeatureDrafterModel) and same_weights(model, fresh)
    assert model.config.hidden_size == target.config.hidden_size


# ---- load_drafter refuses tampered feature drafter files -----------------------------------------

def retune(path: Path, **fields: Any) -> None:
    """Rewrite the feature config in a drafter file's metadata, tensors untouched."""
    metadata = read_metadata(path)
    metadata["feature_config"] = json.dumps({**json.loads(metadata["feature_config"]), **fields})
    save_file(load_file(str(path)), str(path), metadata=metadata)


def tampered(path: Path, change) -> Path:
    metadata = read_metadata(path)
    state = load_file(str(path))
    change(state)
    copy = path.with_name("tampered.safetensors")
    save_file(state, str(copy), metadata=metadata)
    return copy


def set_entry(name: str, index: tuple[int, ...], value: float):
    def change(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].clone()
        state[name][index] = value
    return change


def replace_entry(name: str, make):
    def change(state: dict[str, torch.Tensor]) -> None:
        state[name] = make(state[name])
    return change


TAMPERED = {
    "a draft id past the vocabulary": (set_entry("draft_ids", (3,), TINY.vocab_size), "draft_ids"),
    "a negative draft id": (set_entry("draft_ids", (0,), -1), "draft_ids"),
    "one draft id too few": (replace_entry("draft_ids", lambda ids: ids[:-1].clone()), "draft_ids"),
    "float draft ids": (replace_entry("draft_ids", lambda ids: ids.float()), "draft_ids"),
    "no draft ids": (lambda state: state.pop("draft_ids"), "draft_ids"),
    "a NaN weight": (set_entry("fc.weight", (0, 0), float("nan")), "non-finite"),
    "an infinite weight": (set_entry("head.weight", (5, 1), float("inf")), "non-finite"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(TAMPERED))
def test_load_drafter_refuses_a_tampered_feature_drafter(case: str, dtype: torch.dtype, target,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "drafter.safetensors"
    save_drafter(trained_looking(target), path, fingerprint_of(target), dtype=dtype)
    embedding = target.embed.weight
    assert isinstance(load_drafter(path, fingerprint_of(target), target_embedding=embedding), FeatureDrafterModel)
    change, needle = TAMPERED[case]
    with pytest.raises(CheckpointError, match=needle):
        load_drafter(tampered(path, change), fingerprint_of(target), target_embedding=embedding)


TAMPERED_CONFIG = {
    "kv heads that do not divide the heads": {"num_kv_heads": 3},
    "a non-positive layer size": {"intermediate_size": -4},
    "a fractional size": {"intermediate_size": 64.0},
    "a negative captured layer": {"capture_layers": [-1, 1]},
    "a repeated captured layer": {"capture_layers": [1, 1]},
    "a captured layer that is not a number": {"capture_layers": ["1", 0]},
    "no captured layer": {"capture_layers": []},
    "a draft vocabulary larger than the target's": {"draft_vocab_size": TINY.vocab_size + 1},
}


@pytest.mark.parametrize("case", list(TAMPERED_CONFIG))
def test_load_drafter_refuses_a_feature_drafter_whose_config_was_tampered_with(case: str, target,
                                                                              tmp_path: Path) -> None:
    path = tmp_path / "drafter.safetensors"
    save_drafter(trained_looking(target), path, fingerprint_of(target))
    retune(path, **TAMPERED_CONFIG[case])
    with pytest.raises(CheckpointError, match="unreadable feature-drafter metadata"):
        load_drafter(path, fingerprint_of(target), target_embedding=target.embed.weight)


# ---- self-distilled pretraining and the manifest's checks -----------------------------------------

def test_pretrain_trains_on_the_targets_own_responses(tmp_path: Path) -> None:
    loaded = tiny_loaded_target()
    config = replace(TINY_PRETRAIN, data="distilled", steps=2, distill=DistillConfig(
        prompts=4, max_prompt=120, max_new_tokens=8, batch=2, shard_size=2, dtype="float32"))
    manifest = pretrain(loaded, config, tmp_path / "work", tmp_path / "drafter.safetensors", COMMAND)
    assert "own responses" in manifest["data"]["source"] and manifest["data"]["examples"] == 4
    assert manifest["steps"] == 2 and manifest["tokens_trained"] > 0
    assert len(list((tmp_path / "work" / "distilled").glob("distilled-*.safetensors"))) == 2
    assert check_manifest(tmp_path / "drafter.safetensors", required=True) == manifest


def test_greedy_only_trains_on_the_greedy_answers_and_two_layers_make_a_two_layer_file(tmp_path: Path) -> None:
    loaded = tiny_loaded_target()
    # every 2nd prompt sampled: 2 of the 4 answers are greedy
    config = replace(TINY_PRETRAIN, data="distilled", steps=2, greedy_only=True, drafter_layers=2,
                     distill=DistillConfig(prompts=4, max_prompt=120, max_new_tokens=8, sampled_every=2, batch=2,
                                           shard_size=2, dtype="float32"))
    manifest = pretrain(loaded, config, tmp_path / "work", tmp_path / "drafter.safetensors", COMMAND)
    assert manifest["data"]["examples"] == 2 and "(2 greedy, 0 sampled" in manifest["data"]["source"]
    model = load_drafter(tmp_path / "drafter.safetensors", loaded.fingerprint,
                         target_embedding=loaded.model.embed.weight)
    assert isinstance(model, FeatureDrafterModel) and model.config.num_layers == 2


def test_a_second_run_on_a_work_folder_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    from specd.core.errors import StoreError
    from specd.learner.claim import claim

    first = claim(tmp_path / "work", "", what="pretraining run", lock_name="pretrain.lock")   # a run in progress
    try:
        with pytest.raises(StoreError, match=rf"another pretraining run \(pid {os.getpid()}\)"):
            pretrain(tiny_loaded_target(), replace(TINY_PRETRAIN, steps=2), tmp_path / "work",
                     tmp_path / "drafter.safetensors", COMMAND)
    finally:
        first.release()
    assert not (tmp_path / "work" / "config.json").exists()   # it wrote nothing into the folder in use


def test_greedy_only_on_rounds_that_are_all_sampled_is_refused_before_training(tmp_path: Path) -> None:
    from specd.core.errors import ConfigurationError

    # round 1 alone (a later stage's data) is all sampled: nothing greedy is left to train on
    config = replace(TINY_PRETRAIN, data="distilled", steps=2, greedy_only=True,
                     distill=DistillConfig(prompts=2, max_prompt=120, max_new_tokens=8, rounds=2, first_round=1,
                                           batch=2, shard_size=2, dtype="float32"))
    with pytest.raises(ConfigurationError, match="--greedy-only keeps none"):
        pretrain(tiny_loaded_target(), config, tmp_path / "work", tmp_path / "drafter.safetensors", COMMAND)
    assert not (tmp_path / "drafter.safetensors").exists()


def test_a_drafter_started_from_the_targets_last_layer_holds_its_weights_and_trains_from_them(tmp_path: Path) -> None:
    loaded = tiny_loaded_target()
    target = loaded.model
    last, hidden = target.blocks[-1], target.config.hidden_size
    fresh = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                torch.arange(64))
    started = init_from_target_layer(fresh.clone(), last)
    assert torch.equal(started.attn.qkv.weight[:, hidden:], last.attn.qkv.weight.float())
    assert torch.equal(started.attn.qkv.weight[:, :hidden], fresh.attn.qkv.weight[:, :hidden])  # the embedding half
    assert torch.equal(started.mlp.gate_up.weight, last.mlp.gate_up.weight.float())
    assert torch.allclose(started.mlp.down.weight, 0.1 * last.mlp.down.weight.float())
    assert torch.allclose(started.attn.o.weight, 0.1 * last.attn.o.weight.float())
    assert torch.equal(started.hidden_norm.weight, last.attn_norm.weight.float())
    assert torch.equal(started.head.weight, fresh.head.weight) and torch.equal(started.fc.weight, fresh.fc.weight)

    config = replace(TINY_PRETRAIN, steps=2, init="target_layer")
    manifest = pretrain(loaded, config, tmp_path / "work", tmp_path / "drafter.safetensors", COMMAND)
    assert manifest["settings"]["init"] == "target_layer" and manifest["steps"] == 2
    trained = load_drafter(tmp_path / "drafter.safetensors", loaded.fingerprint, target_embedding=target.embed.weight)
    assert isinstance(trained, FeatureDrafterModel)
    # two small steps from the target's weights stay near them, far nearer than a random start is
    gap = (trained.mlp.gate_up.weight - last.mlp.gate_up.weight.float()).norm()
    assert gap < 0.2 * (fresh.mlp.gate_up.weight - last.mlp.gate_up.weight.float()).norm()
    with pytest.raises(ValueError, match="init must be one of"):
        replace(TINY_PRETRAIN, init="zeros")


def test_a_work_folder_started_before_a_setting_existed_resumes_with_its_default(pretrained,
                                                                                  tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(pretrained["work"], work)
    saved = json.loads((work / "config.json").read_text())
    for added in ("drafter_layers", "greedy_only"):  # settings newer than some work folders
        del saved[added]
    (work / "config.json").write_text(json.dumps(saved))
    manifest = pretrain(pretrained["loaded"], TINY_PRETRAIN, work, tmp_path / "drafter.safetensors", COMMAND)
    assert manifest["steps"] == pretrained["manifest"]["steps"]
    with pytest.raises(ConfigurationError, match="started with other settings"):
        pretrain(pretrained["loaded"], replace(TINY_PRETRAIN, drafter_layers=2), work, tmp_path / "other.safetensors",
                 COMMAND)


def test_the_shipped_drafter_names_its_recipe_data_hashes_and_figure() -> None:
    manifest = check_manifest(SHIPPED_DRAFTER, required=True)
    assert manifest is not None
    # the shipped file is what its recipes make, stage on stage: the same settings, nothing hand-made
    stage: dict | None = manifest
    recipes = []
    while stage is not None:
        recipe = stage["command"].split()[3]
        assert stage["command"].startswith(f"specd pretrain --recipe {recipe} ")
        assert "own responses" in stage["data"]["source"]
        assert stage["held_out"]["accept_length"] == stage["held_out"]["evaluation"]["accept_length"]
        parent = stage.get("parent")
        if recipe in RECIPE_PARENTS:
            assert parent is not None and parent["command"].split()[3] == RECIPE_PARENTS[recipe]
            assert stage["settings"]["parent"] == parent["file_sha256"]
            # every stage is judged on the same held-out prompts
            assert {name: stage["held_out"][name]["sha256"] for name in ("validation", "evaluation")} == \
                {name: parent["held_out"][name]["sha256"] for name in ("validation", "evaluation")}
        else:
            assert parent is None
        assert replace(config_from_settings(stage["settings"]), parent=None) == RECIPES[recipe]
        recipes.append(recipe)
        stage = parent
    assert recipes[-1] == "shipped" and len(recipes) >= 2
    assert SHIPPED_DRAFTER.stat().st_size <= 32 * 2**20


def shipped_copy(tmp_path: Path) -> Path:
    path = tmp_path / "shipped.safetensors"
    shutil.copy(SHIPPED_DRAFTER, path)
    shutil.copy(SHIPPED_DRAFTER.with_suffix(".json"), path.with_suffix(".json"))
    return path


def edit_json(path: Path, change) -> None:
    beside = path.with_suffix(".json")
    written = json.loads(beside.read_text())
    change(written)
    beside.write_text(json.dumps(written))


def strip_manifest(path: Path) -> None:
    metadata = read_metadata(path)
    metadata.pop("manifest")
    save_file(load_file(str(path)), str(path), metadata=metadata)
    path.with_suffix(".json").unlink()


MANIFEST_FAULTS = {
    "a .json whose figure was edited": (lambda p: edit_json(p, lambda m: m["held_out"].update(accept_length=4.9)),
                                        "differ"),
    "a file that is not the one the .json names": (lambda p: edit_json(p, lambda m: m.update(file_sha256="0" * 64)),
                                                   "sha256"),
    "no manifest at all": (strip_manifest, "no manifest"),
    "a .json that is not JSON": (lambda p: p.with_suffix(".json").write_text("{half"), "not a readable manifest"),
}


@pytest.mark.parametrize("case", list(MANIFEST_FAULTS))
def test_a_shipped_file_whose_manifest_does_not_check_out_is_refused(case: str, tmp_path: Path) -> None:
    path = shipped_copy(tmp_path)
    change, needle = MANIFEST_FAULTS[case]
    change(path)
    with pytest.raises(CheckpointError, match=needle):
        check_manifest(path, required=True)


def test_batches_come_from_one_length_bucket_and_cover_every_example() -> None:
    import itertools
    import random

    from specd.offline.training_loop import length_buckets, sample_batch

    rng = random.Random(3)
    lengths = [rng.randrange(10, 500) for _ in range(203)]
    buckets = length_buckets(lengths, batch_size=4, per_bucket=5)
    assert sorted(i for b in buckets for i in b) == list(range(203))
    assert all(max(lengths[i] for i in a) <= min(lengths[i] for i in b) for a, b in itertools.pairwise(buckets))
    drawn = [sample_batch(buckets, 4, random.Random(step)) for step in range(2000)]
    assert drawn[:5] == [sample_batch(buckets, 4, random.Random(step)) for step in range(5)]  # seed and step alone
    assert all(len(set(batch)) == len(batch) and any(set(batch) <= set(b) for b in buckets) for batch in drawn)
    assert {i for batch in drawn for i in batch} == set(range(203))


def test_where_prompts_weigh_nothing_a_bucket_holds_examples_that_start_labelling_together() -> None:
    import itertools
    import random

    from specd.offline.training_loop import first_labelled, length_buckets

    rng = random.Random(5)
    prompts = [rng.randrange(5, 300) for _ in range(150)]
    weights = [torch.cat([torch.zeros(p), torch.ones(rng.randrange(3, 128))]) for p in prompts]
    starts = [first_labelled(w) for w in weights]
    assert starts == [p - 1 for p in prompts]  # weights[i] weighs entry i - 1
    buckets = length_buckets([len(w) for w in weights], batch_size=4, per_bucket=5, starts=starts)
    assert sorted(i for b in buckets for i in b) == list(range(150))
    assert all(max(starts[i] for i in a) <= min(starts[i] for i in b) for a, b in itertools.pairwise(buckets))
    # prompts that weigh something label from entry 0: the order is by length alone, as before
    lengths = [len(w) for w in weights]
    assert length_buckets(lengths, 4, 5, starts=[0] * 150) == length_buckets(lengths, 4, 5)
