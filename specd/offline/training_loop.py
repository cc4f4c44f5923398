"""The pretraining loop (`specd pretrain`'s training stage) over a corpus held in memory.

Contract: `Trainer(model, rows, config, work)` resumes from `work` (weights, optimiser, progress
and, with `config.keep == "best"`, the best weights so far; ConfigurationError where it has trained
past `config.steps`) and `run(corpus, held_out)` trains to
`config.steps` or `config.max_seconds`: each step's batch depends on the seed and the step alone
(a resumed run trains as an unbroken one), drawn from one length bucket (`length_buckets`,
`sample_batch`); every `eval_every` steps the held-out accept length of both sets (k =
`eval_k`, greedy, simulated exactly) joins `curve`; every `checkpoint_every` steps the state is
written as .tmp files and renamed together, progress last. `kept_point` and `kept_model()` are
the curve point and weights the version file gets: the last, or the best on validation.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specd.core.errors import ConfigurationError
from specd.drafter.feature_model import FeatureDrafterModel
from specd.learner.feature_signal import collate, feature_loss
from specd.learner.simulation import simulated_counts
from specd.offline.corpus import HeldOut, TrainingCorpus

if TYPE_CHECKING:
    from specd.offline.pretrain import PretrainConfig

log = logging.getLogger(__name__)


def held_out_accept_length(model: FeatureDrafterModel, held_out: HeldOut, k: int) -> float:
    was_training = model.training
    model.eval()
    counts = simulated_counts(model, held_out, k)
    model.train(was_training)
    return counts.accept_length or 0.0


def length_buckets(lengths: list[int], batch_size: int, per_bucket: int = 8,
                   starts: list[int] | None = None) -> list[list[int]]:
    """Example indices by length, cut into buckets of about `per_bucket` batches: a batch drawn from
    one bucket pads little (padded positions cost as much as real ones). With `starts` (each
    example's first labelled entry) they are ordered by it first: where prompts weigh 0, a batch's
    rows then start labelling together and the loss skips their common unlabelled lead."""
    first = starts or [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (first[i], lengths[i], i))
    size = max(batch_size, batch_size * per_bucket)
    return [order[i:i + size] for i in range(0, len(order), size)]


def first_labelled(weights: torch.Tensor) -> int:
    """An example's first entry whose label weighs anything (`weights[i]` weighs entry i - 1)."""
    weighed = (weights[1:] > 0).nonzero()
    return int(weighed[0]) if len(weighed) else len(weights)


def sample_batch(buckets: list[list[int]], batch_size: int, rng: random.Random) -> list[int]:
    """A bucket chosen in proportion to its size, then `batch_size` examples from it: every example
    is as likely as any other to be drawn."""
    bucket = rng.choices(buckets, weights=[len(b) for b in buckets])[0]
    return rng.sample(bucket, min(batch_size, len(bucket)))


class Trainer:
    """The training loop over a corpus held in memory, resumable from the work folder."""

    def __init__(self, model: FeatureDrafterModel, rows: torch.Tensor, config: PretrainConfig, work: Path) -> None:
        self.model, self.rows, self.config, self.work = model.float().train(), rows, config, work
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        self.step = 0
        self.tokens = 0
        self.curve: list[dict[str, Any]] = []
        self.seconds = 0.0
        # keep="best": the weights of `kept_point` (the curve's best on validation), and whether the
        # work folder's copy is behind them
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_unsaved = False
        self._resume()

    def _resume(self) -> None:
        state = self.work / "train-state.safetensors"
        if not state.is_file():
            return
        self.model.load_state_dict(load_file(str(state)), strict=True)
        self.optimizer.load_state_dict(torch.load(self.work / "optimizer.pt", weights_only=True))
        progress = json.loads((self.work / "progress.json").read_text())
        if progress["step"] > self.config.steps:
            # the version file would hold later weights than its settings say
            raise ConfigurationError(f"{self.work} has already trained {progress['step']} steps, more than "
                                     f"--steps {self.config.steps}: give --steps {progress['step']} or more, "
                                     f"or another --work")
        self.step, self.tokens, self.seconds = progress["step"], progress["tokens"], progress["seconds"]
        self.curve = progress["curve"]
        if self.config.keep == "best" and (self.work / "best.safetensors").is_file():
            self.best_state = load_file(str(self.work / "best.safetensors"))
        log.info("resuming at step %d (%d tokens trained)", self.step, self.tokens)

    def checkpoint(self) -> None:
        """Weights, optimiser and progress of one step, replaced together (progress last: it names the step)."""
        save_file({n: t.detach().contiguous() for n, t in self.model.state_dict().items()},
                  str(self.work / "train-state.tmp"))
        torch.save(self.optimizer.state_dict(), self.work / "optimizer.tmp")
        files = ["train-state.safetensors", "optimizer.pt", "progress.json"]
        if self.best_state is not None and self.best_unsaved:
            save_file(self.best_state, str(self.work / "best.tmp"))
            files.insert(0, "best.safetensors")
            self.best_unsaved = False
        (self.work / "progress.tmp").write_text(json.dumps(
            {"step": self.step, "tokens": self.tokens, "seconds": self.seconds, "curve": self.curve}))
        for name in files:
            stem = name.split(".")[0]
            (self.work / f"{stem}.tmp").replace(self.work / name)

    def learning_rate(self) -> float:
        cfg = self.config
        if self.step < cfg.warmup_steps:
            return cfg.learning_rate * (self.step + 1) / cfg.warmup_steps
        # linear decay to a tenth: late steps refine, they do not undo
        done = (self.step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.learning_rate * (1 - 0.9 * min(1.0, done))

    @property
    def out_of_time(self) -> bool:
        return self.config.max_seconds is not None and self.seconds >= self.config.max_seconds

    def run(self, corpus: TrainingCorpus, held_out: dict[str, HeldOut]) -> None:
        cfg = self.config
        buckets = length_buckets([len(seq) for seq in corpus.sequences], cfg.batch_size,
                                 starts=[first_labelled(weights) for weights in corpus.weights])
        if not self.curve:
            self._evaluate(held_out)
        progress = tqdm(total=cfg.steps, initial=self.step, desc="pretraining", unit="step")
        while self.step < cfg.steps and not self.out_of_time:
            begin = time.perf_counter()
            # each step's batch depends on the seed and the step alone: a resumed run trains as an unbroken one
            picked = sample_batch(buckets, cfg.batch_size, random.Random(cfg.seed * 1_000_003 + self.step))
            batch = collate([(corpus.sequences[i], corpus.features[i], corpus.weights[i]) for i in picked])
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate()
            # the per-step statistics cost an argmax over the draft vocabulary: only curve points need them
            wanted = (self.step + 1) % cfg.eval_every == 0 or self.step + 1 == cfg.steps
            with torch.autocast(self.rows.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16"):
                loss, stats = feature_loss(self.model, batch, self.rows, cfg.unroll, cfg.step_decay, cfg.objective,
                                           with_stats=wanted)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            self.tokens += batch.num_tokens
            self.seconds += time.perf_counter() - begin
            progress.update()
            progress.set_postfix(loss=f"{float(loss.detach()):.3f}",
                                 tok_s=f"{self.tokens / max(self.seconds, 1e-9):.0f}")
            last = self.step == cfg.steps or self.out_of_time
            if self.step % cfg.eval_every == 0 or last:
                self._evaluate(held_out, stats)
            if self.step % cfg.checkpoint_every == 0 or last:
                self.checkpoint()
        progress.close()

    @property
    def kept_point(self) -> dict[str, Any]:
        """The curve point of the weights the version file holds: the last, or the first of the best
        on validation."""
        if self.config.keep == "best":
            return max(self.curve, key=lambda point: point["validation_accept_length"])
        return self.curve[-1]

    def kept_model(self) -> FeatureDrafterModel:
        if self.config.keep == "best" and self.best_state is not None:
            self.model.load_state_dict(self.best_state, strict=True)
        return self.model

    def _evaluate(self, held_out: dict[str, HeldOut], stats: dict[str, float] | None = None) -> None:
        point: dict[str, Any] = {"step": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1)}
        for name, sequences in held_out.items():
            point[f"{name}_accept_length"] = round(held_out_accept_length(self.model, sequences,
                                                                          self.config.eval_k), 4)
        point.update({k: round(v, 4) for k, v in (stats or {}).items()})
        self.curve.append(point)
        if self.config.keep == "best" and self.kept_point is point:
            self.best_state = {n: t.detach().clone().contiguous() for n, t in self.model.state_dict().items()}
            self.best_unsaved = True
        figures = ", ".join(f"{name} {point[f'{name}_accept_length']:.3f}" for name in held_out)
        log.info("step %d: held-out accept length %s", self.step, figures)
        tqdm.write(f"step {self.step} tokens {self.tokens} ({self.seconds:.0f} s): held-out accept length {figures}")
        (self.work / "curve.json").write_text(json.dumps(self.curve, indent=1))
