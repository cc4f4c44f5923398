"""`specd pretrain`: train a feature drafter offline, on the target's own responses or on ShareGPT text.

Contract: everything lives in one work folder and every stage resumes where it stopped:
1. the training corpus (`specd.offline.corpus`): by default ("distilled") the target's own
   responses to user turns of the training conversations, generated with their features by
   specd's engine in `distill.dtype`; or ("sharegpt") the conversations' own text. Only
   `traffic.TRAINING_RANGE` is ever read;
2. `validation.safetensors` (from `traffic.VALIDATION_RANGE`, chooses settings) and
   `evaluation.safetensors` (from `traffic.EVALUATION_START` on, reports the figure): held-out
   first user turns with the target's own greedy continuations and their features;
3. training (`specd.offline.training_loop`), checkpointed atomically every `checkpoint_every`
   steps (weights, optimiser and progress written as .tmp and renamed together), with the
   held-out accept length (k = `eval_k`, greedy, simulated exactly) on both sets every
   `eval_every` steps in `curve.json`.
   `max_seconds` stops training at a time budget (for arms compared at equal time). With
   `keep="best"` the file holds the weights of the evaluation point with the best validation
   accept length (kept in memory and written with each checkpoint) instead of the last ones.
Training starts from a new drafter, or continues an earlier version file (`parent`: one made by
`specd pretrain`, its manifest checked); the settings then hold that file's sha256 (a work folder
never resumes onto another start) and the manifest holds the parent's own, so the chain of
commands from nothing to the file is on record.
The result is a drafter version file (fp16, no embedding) whose metadata and the `.json` beside
it hold the manifest: the command, settings, data and evaluation hashes, tokens, steps, seed, the
held-out accept lengths of the file as written (and in training, in float32) and the curve.
The shipped file is made in three stages: `RECIPES["shipped"]` from nothing, then
`RECIPES["shipped-2"]` from that file and `RECIPES["shipped-3"]` from stage 2's (`RECIPE_PARENTS`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from specd.core.errors import CheckpointError, ConfigurationError
from specd.core.traffic import EVALUATION_START, TRAINING_RANGE, VALIDATION_RANGE
from specd.drafter.checkpoint import save_drafter
from specd.drafter.feature_model import (
    FeatureDrafterConfig,
    FeatureDrafterModel,
    init_from_target_layer,
    new_feature_drafter,
)
from specd.drafter.pretrained import check_manifest, load_pretrained
from specd.learner.claim import claim
from specd.learner.feature_signal import label_rows
from specd.model.target import DTYPES, LoadedTarget
from specd.model.transformer import Block
from specd.offline.corpus import (
    SOURCES,
    HeldOut,
    TrainingCorpus,
    distilled_corpus,
    held_out_set,
    sharegpt_corpus,
    tensor_hash,
)
from specd.offline.distill import DistillConfig
from specd.offline.training_loop import Trainer, held_out_accept_length

log = logging.getLogger(__name__)


INITS = ("random", "target_layer")
KEEPS = ("last", "best")


@dataclass(frozen=True)
class PretrainConfig:
    data: str = "distilled"        # "distilled" (the target's own responses) or "sharegpt" (ShareGPT's text)
    conversations: int = 1200      # sharegpt: conversations read
    max_length: int = 384          # sharegpt: tokens kept per conversation
    prompt_weight: float = 0.2     # distilled: label weight of prompt positions (responses weigh 1)
    greedy_only: bool = False      # distilled: train on the greedy answers only (all are generated)
    draft_vocab: int = 8192
    drafter_layers: int = 1        # decoder layers of the drafter (EAGLE-3: one)
    init: str = "random"           # the first layer's start: "random", or "target_layer" (the target's last)
    parent: str | None = None      # the sha256 of the version file training continues (set by `pretrain`)
    steps: int = 4000
    batch_size: int = 8
    learning_rate: float = 6e-4
    warmup_steps: int = 100
    unroll: int = 3
    step_decay: float = 0.8
    objective: str = "kl"
    precision: str = "bfloat16"    # training matmuls under bf16 autocast (2x float32's step rate here, AMX);
    #                                evaluation always runs in float32, as the drafter serves
    eval_prompts: int = 32
    eval_tokens: int = 96
    eval_k: int = 4
    eval_every: int = 250
    checkpoint_every: int = 50
    max_seconds: float | None = None  # stop training after this many training seconds
    keep: str = "last"             # the weights written: the last, or the best on validation ("best")
    shard_size: int = 64
    seed: int = 0
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.keep not in KEEPS:
            raise ValueError(f"keep must be one of {KEEPS}, got {self.keep!r}")
        if self.precision not in ("bfloat16", "float32"):
            raise ValueError(f"precision must be bfloat16 or float32, got {self.precision!r}")
        if self.data not in SOURCES:
            raise ValueError(f"data must be one of {SOURCES}, got {self.data!r}")
        if self.distill.dtype not in DTYPES:
            raise ValueError(f"distill dtype must be one of {sorted(DTYPES)}, got {self.distill.dtype!r}")
        if self.steps < 1 or self.batch_size < 1 or self.eval_every < 1 or self.checkpoint_every < 1 \
                or self.drafter_layers < 1:
            raise ValueError("steps, batch, eval_every, checkpoint_every and drafter_layers must be positive")
        # a learning rate of 0 is allowed: it continues a file with its weights unchanged (a test does)
        if not (0 <= self.learning_rate < math.inf and 0 <= self.prompt_weight < math.inf) \
                or (self.max_seconds is not None and not 0 < self.max_seconds < math.inf):
            raise ValueError("learning rate and prompt weight must be finite and not negative, max seconds finite "
                             "and positive")


# The shipped drafter's first stage: `specd pretrain --recipe shipped` from nothing. One round of answers
# to every user turn and a long schedule: at equal steps more rounds or more data did not help, more
# steps did (the accept length rose about 0.14 per doubling of steps; docs/pretraining.md).
_STAGE_1 = PretrainConfig(data="distilled", prompt_weight=0.0, steps=12000, eval_every=250,
                          distill=DistillConfig(rounds=1, later_turns=True))
RECIPES: dict[str, PretrainConfig] = {
    "shipped": _STAGE_1,
    # the second stage continues the first's file (--init-from) on new sampled answers to a draw of its
    # prompts, at the learning rate the first ended on (at 2e-4 the validation accept length fell after
    # 500 steps), keeping the weights best on validation: a few passes over new data peak, then
    # memorise it (docs/measurements.md, "The shipped drafter's second stage")
    "shipped-2": replace(_STAGE_1, steps=1500, learning_rate=6e-5, eval_every=250, keep="best",
                         distill=replace(_STAGE_1.distill, rounds=2, first_round=1, sample=2112)),
    # the third continues the second's file on a third sampled answer to every training prompt (round 2,
    # about three times stage 2's new data, so twice its steps at the same rate), again keeping the best
    "shipped-3": replace(_STAGE_1, steps=3000, learning_rate=6e-5, eval_every=250, keep="best",
                         distill=replace(_STAGE_1.distill, rounds=3, first_round=2)),
}
# a stage's recipe continues a version file its parent recipe made: `--init-from` is required
RECIPE_PARENTS = {"shipped-2": "shipped", "shipped-3": "shipped-2"}


def as_settings(config: PretrainConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_settings(settings: dict[str, Any]) -> PretrainConfig:
    fields = dict(settings)
    fields["distill"] = DistillConfig(**fields["distill"])
    return PretrainConfig(**fields)


def generation_target(loaded: LoadedTarget, dtype: str) -> LoadedTarget:
    """The target in the dtype that generates the training data (a copy when it differs)."""
    wanted = DTYPES[dtype]
    if loaded.model.embed.weight.dtype == wanted:
        return loaded
    return LoadedTarget(loaded.folder, copy.deepcopy(loaded.model).to(wanted), loaded.tokenizer)


def training_corpus(loaded: LoadedTarget, config: PretrainConfig, capture: tuple[int, ...],
                    work: Path) -> TrainingCorpus:
    generator = generation_target(loaded, config.distill.dtype)
    if config.data == "distilled":
        return distilled_corpus(generator, config.distill, capture, config.draft_vocab, config.prompt_weight, work,
                                config.greedy_only)
    return sharegpt_corpus(generator, config.conversations, config.max_length, config.draft_vocab, capture,
                           config.shard_size, work)


def held_out_sets(loaded: LoadedTarget, config: PretrainConfig, capture: tuple[int, ...],
                  work: Path) -> dict[str, HeldOut]:
    """The validation set (chooses settings) and the evaluation set (reports), from disjoint spans."""
    spans = {"validation": VALIDATION_RANGE, "evaluation": range(EVALUATION_START, 10**9)}
    return {name: held_out_set(loaded, span, config.eval_prompts, config.eval_tokens, capture,
                               work / f"{name}.safetensors") for name, span in spans.items()}


def continued(loaded: LoadedTarget, parent: Path, config: PretrainConfig) -> tuple[FeatureDrafterModel, dict[str, Any]]:
    """The drafter in version file `parent` and its manifest with the file's sha256 (its curve left
    out); ConfigurationError if it is not a `specd pretrain` file made for this target, or its draft
    vocabulary and layers are not the ones `config` asks for."""
    try:
        model = load_pretrained(parent, loaded.model, loaded.fingerprint, require_manifest=True)
        manifest = check_manifest(parent, required=True)
    except CheckpointError as error:
        raise ConfigurationError(f"cannot continue from {parent}: {error}") from None
    assert manifest is not None
    shape = (model.config.draft_vocab_size, model.config.num_layers)
    if shape != (min(config.draft_vocab, loaded.model.config.vocab_size), config.drafter_layers):
        raise ConfigurationError(f"{parent} has {shape[0]} draft ids and {shape[1]} layer(s); the settings ask "
                                 f"for {config.draft_vocab} and {config.drafter_layers}")
    record = {key: value for key, value in manifest.items() if key != "curve"}
    return model, {**record, "file_sha256": hashlib.sha256(parent.read_bytes()).hexdigest()}


def claim_work_folder(work: Path, config: PretrainConfig) -> None:
    """Write `config` into `work`; ConfigurationError if the folder was started with other settings
    (a new budget of steps or time is a continuation, not other settings)."""
    work.mkdir(parents=True, exist_ok=True)
    settings = work / "config.json"
    if settings.is_file():
        budget = ("steps", "max_seconds", "eval_every", "checkpoint_every")
        # a setting added since the folder was started reads as its default (what that run used)
        saved = as_settings(config_from_settings(json.loads(settings.read_text())))
        if {k: v for k, v in saved.items() if k not in budget} != \
                {k: v for k, v in as_settings(config).items() if k not in budget}:
            raise ConfigurationError(f"{work} was started with other settings ({settings}): use another work "
                                     f"folder, or the same settings")
    settings.write_text(json.dumps(as_settings(config), indent=1))


def pretrain(loaded: LoadedTarget, config: PretrainConfig, work: Path, out: Path, command: str,
             parent: Path | None = None) -> dict[str, Any]:
    """Run (or resume) every stage and write the version file `out`; returns its manifest. With
    `parent`, training continues that version file's drafter (its draft vocabulary and layers)."""
    from_model, parent_manifest = continued(loaded, parent, config) if parent is not None else (None, None)
    if parent_manifest is not None:
        config = replace(config, parent=parent_manifest["file_sha256"])
    held = claim(work, "wait for it, or give this run another --work", what="pretraining run",
                 lock_name="pretrain.lock", per="work folder")
    try:
        return _pretrain(loaded, config, work, out, command, from_model, parent_manifest)
    finally:
        held.release()


def _pretrain(loaded: LoadedTarget, config: PretrainConfig, work: Path, out: Path, command: str,
              from_model: FeatureDrafterModel | None, parent_manifest: dict[str, Any] | None) -> dict[str, Any]:
    claim_work_folder(work, config)
    torch.manual_seed(config.seed)
    target = loaded.model
    capture = (from_model.config if from_model is not None else
               FeatureDrafterConfig.for_target(target.config, config.draft_vocab)).capture_layers
    corpus = training_corpus(loaded, config, capture, work)
    if from_model is not None:
        model = from_model.float()
    else:
        model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                    corpus.draft_ids, seed=config.seed, num_layers=config.drafter_layers)
    if from_model is None and config.init == "target_layer":
        init_from_target_layer(model, cast(Block, target.blocks[-1]))
    held_out = held_out_sets(loaded, config, capture, work)
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight)
    trainer = Trainer(model, rows, config, work)
    trainer.run(corpus, held_out)
    last, kept = trainer.kept_point, trainer.kept_model()
    # the figures of the file as written (fp16 weights), which is what serves; the curve's are float32
    as_written = copy.deepcopy(kept).half().float()
    figures = {name: round(held_out_accept_length(as_written, sets, config.eval_k), 4)
               for name, sets in held_out.items()}
    manifest = {
        "kind": "feature", "command": command, "seed": config.seed, "settings": as_settings(config),
        "data": {"source": corpus.description, "examples": len(corpus.sequences), "tokens": corpus.num_tokens,
                 "conversations": f"{TRAINING_RANGE.start}-{TRAINING_RANGE.stop - 1}",
                 "sha256": tensor_hash(corpus.sequences), "draft_vocab_coverage": corpus.coverage},
        "steps": trainer.step, "kept_step": last["step"], "tokens_trained": trainer.tokens,
        "training_seconds": round(trainer.seconds, 1),
        "held_out": {
            "k": config.eval_k,
            **{name: {"prompts": len(sets), "sha256": tensor_hash([t for t, _, _ in sets]),
                      "accept_length": figures[name], "in_training": last[f"{name}_accept_length"]}
               for name, sets in held_out.items()},
            # the figure a drafter is reported by: evaluation prompts it never trained or was tuned on
            "accept_length": figures["evaluation"],
        },
        "curve": trainer.curve,
        **({"parent": parent_manifest} if parent_manifest is not None else {}),
    }
    save_drafter(kept, out, loaded.fingerprint, extra={"manifest": json.dumps(manifest)},
                 dtype=torch.float16)
    manifest_file = {**manifest, "file_sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    out.with_suffix(".json").write_text(json.dumps(manifest_file, indent=1))
    return manifest


def recipe(name: str, **overrides: Any) -> PretrainConfig:
    if name not in RECIPES:
        raise ConfigurationError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    return replace(RECIPES[name], **overrides)
