"""The asynchronous learner: intake, buffer, training, evaluation gate and publishing.

Contract: the learner only ever talks to a bus (records in) and a weight store (versions out); it
runs in its own thread (`start`) or step by step (`step`), never inside a decoding step. What it
trains and how it scores a drafter come from its objective (`specd.learner.objectives`): the
token-level drafter on ids, or the feature drafter on the target's features (carried by records
or recomputed from ids with the learner's own copy of the target). Intake
validates every record and counts refusals by reason. Training samples windows from a bounded
buffer of recent trajectories (`recent_share` of each batch from the newest `recent_records`);
every `holdout_every`-th record, greedy or sampled, is held out for the gate
(`specd.learner.gate`) instead.
Every `publish_every_steps` steps or `publish_every_seconds` seconds the trained drafter becomes
a candidate, but only once at least `gate_min_held_out` records are held out: until then the
learner publishes nothing, counts the wait (`stats.gate_waits`) and trains on. A candidate is
published and made live if its simulated accept length on the held-out records is not worse than
the live version's by more than `gate_margin` and its weights are finite, rejected (with the
reason in its manifest) otherwise. Promotion is a compare-and-set against the live version the
learner last saw: if an operator or the canary changed it meanwhile, theirs stands, the learner
trains on from it and publishes nothing for `hold_after_rollback_s`. `duty_cycle` caps the share
of wall time spent training, so a learner beside serving leaves the cores to decoding. The thread
survives any Exception in a step: it is logged with its traceback, counted
(`stats.loop_failures`, `stats.last_failure`, both in `health()`), and the loop backs off a second.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specd.core.errors import ConfigurationError, RecordRefused, SpecdError
from specd.core.records import TrajectoryRecord, validate_record
from specd.core.threads import lower_thread_priority
from specd.drafter.checkpoint import DrafterModel, clone_drafter, load_drafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.hotswap.store import LiveVersionChanged, WeightStore
from specd.learner.gate import Gate
from specd.learner.objectives import FeatureObjective, Objective, TokenObjective
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer
from specd.transport.bus import Bus

log = logging.getLogger(__name__)

FAILURE_BACKOFF_S = 1.0  # after a failed step: a persistent fault is retried once a second, not in a hot loop


@dataclass(frozen=True)
class LearnerConfig:
    learning_rate: float = 2e-3
    batch_size: int = 8
    window: int = 96
    negative_coef: float = 0.0       # chosen by benchmarks/negative_term.py; see the README
    miss_weight: float = 2.0
    prompt_weight: float = 0.1
    buffer_capacity: int = 2000
    feature_learning_rate: float = 5e-5  # the feature drafter starts trained: larger steps undo it (learning_curve.py)
    feature_buffer_capacity: int = 400   # feature records are large (~4.6 KB a token for SmolLM2)
    feature_window: int = 256
    feature_prompt_weight: float = 0.5  # prompt positions carry the target's real features and labels too
    unroll: int = 3                      # drafting steps trained per position (feature drafter)
    # half of every batch comes from the newest records, so that a shift in traffic is learned
    # within steps, not after the buffer has turned over (the rest keeps older knowledge)
    recent_share: float = 0.5
    recent_records: int = 32
    holdout_every: int = 8
    holdout_capacity: int = 16
    publish_every_steps: int = 10
    publish_every_seconds: float = 15.0
    gate_margin: float = 0.05       # a candidate may trail the live version by this much accept length
    gate_min_held_out: int = 4      # below this many held-out records the gate waits: no evidence, no pass
    hold_after_rollback_s: float = 60.0  # after someone else changes the live version, publish nothing this long
    k: int = 4
    min_records: int = 2
    duty_cycle: float = 0.5
    train_embeddings: bool = False   # the target's embeddings are a good, frozen start
    # training matmuls under bf16 autocast: about twice float32's steps per second where the CPU
    # has bf16 units (AMX); the gate always replays in float32, as the drafter serves
    precision: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.duty_cycle <= 1:
            raise ConfigurationError(f"duty_cycle must be in (0, 1], got {self.duty_cycle}")
        if self.batch_size < 1 or self.window < 2:
            raise ConfigurationError("batch_size must be at least 1 and window at least 2")
        if self.holdout_every < 1:
            raise ConfigurationError(f"holdout_every must be at least 1, got {self.holdout_every}")
        if self.precision not in ("float32", "bfloat16"):
            raise ConfigurationError(f"precision must be float32 or bfloat16, got {self.precision!r}")
        if self.gate_min_held_out < 1:
            raise ConfigurationError(f"gate_min_held_out must be at least 1 (the gate never passes a candidate "
                                     f"without held-out evidence), got {self.gate_min_held_out}")
        if self.holdout_capacity < self.gate_min_held_out:
            raise ConfigurationError(f"holdout_capacity ({self.holdout_capacity}) must be at least gate_min_held_out "
                                     f"({self.gate_min_held_out}), or no candidate could ever pass the gate")


@dataclass
class LearnerStats:
    records_in: int = 0
    refused: Counter = field(default_factory=Counter)
    steps: int = 0
    tokens_trained: int = 0
    records_trained: int = 0
    losses: deque = field(default_factory=lambda: deque(maxlen=100))
    published: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    training_seconds: float = 0.0
    gate_waits: int = 0              # publications due but skipped: too few held-out records
    loop_failures: int = 0           # steps of the learner thread that raised
    last_failure: dict[str, Any] | None = None  # {"error": "Type: message", "time": unix seconds}


class LearnerHandle(Protocol):
    """What a server reads of its embedded learner, a thread (`Learner`) or a process
    (`specd.learner.process.LearnerProcess`): counters, lag, and the gate for operators' candidates."""

    @property
    def stats(self) -> LearnerStats: ...

    @property
    def staleness(self) -> dict[str, Any]: ...

    def submit(self, version: int) -> Future[dict[str, Any]]: ...

    def health(self) -> dict[str, Any]: ...

    def start(self) -> object: ...

    def stop(self) -> object: ...


class Learner:
    def __init__(self, config: LearnerConfig, bus: Bus, store: WeightStore, initial: DrafterModel,
                 fingerprint: TargetFingerprint, serving_dtype: torch.dtype = torch.float32,
                 target_embedding: torch.Tensor | None = None, target: Transformer | None = None) -> None:
        self.config = config
        self.bus = bus
        self.store = store
        self.fingerprint = fingerprint
        self.serving_dtype = serving_dtype
        self.target_embedding = target_embedding  # versions that keep it frozen reference it, not copy it
        self.vocab_size = initial.config.vocab_size
        live = store.live_version()
        if live is not None:  # a restarted learner resumes from what is serving
            initial = load_drafter(store.weights_path(live), fingerprint, target_embedding=target_embedding)
        self.model = clone_drafter(initial).float().train()
        self.objective = self._objective(self.model, target)
        capacity, learning_rate = config.buffer_capacity, config.learning_rate
        if isinstance(self.model, FeatureDrafterModel):
            capacity, learning_rate = config.feature_buffer_capacity, config.feature_learning_rate
        else:
            self.model.embed.weight.requires_grad_(config.train_embeddings)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
        self.buffer: deque[TrajectoryRecord] = deque(maxlen=capacity)
        self.gate = Gate(config.holdout_every, config.holdout_capacity, config.gate_min_held_out, config.gate_margin)
        self.stats = LearnerStats()
        self.rng = random.Random(config.seed)
        self._last_publish = time.monotonic()
        self._steps_at_publish = 0
        self._staleness: dict[str, Any] | None = None
        self._hold_until = 0.0
        self._gate_waiting = False
        self._stop = threading.Event()
        self._submitted: queue.SimpleQueue[tuple[int, Future[dict[str, Any]]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.live_version = live
        if live is None:  # day 0: the untrained drafter is version 1, live while nothing else is
            first = self._publish(self.model, {"evaluation": None, "reason": "initial"})
            try:
                store.set_live(first, "initial", if_live=None)
                self.live_version = first
            except LiveVersionChanged:  # another learner or an operator was first: resume from theirs
                self._adopt(store.live_version())

    def _objective(self, model: DrafterModel, target: Transformer | None) -> Objective:
        cfg = self.config
        if isinstance(model, FeatureDrafterModel):
            if target is None:
                raise ConfigurationError("a feature drafter's learner needs the target (labels, recomputed features)")
            return FeatureObjective(target, model.draft_ids, model.config.capture_layers, cfg.feature_window,
                                    cfg.unroll, cfg.miss_weight, cfg.feature_prompt_weight,
                                    cache_records=cfg.feature_buffer_capacity + cfg.holdout_capacity)
        return TokenObjective(cfg.window, cfg.miss_weight, cfg.prompt_weight, cfg.negative_coef)

    # ---- intake ---------------------------------------------------------------------------
    def intake(self, timeout: float = 0.0) -> int:
        taken = 0
        for raw in self.bus.take(1024, timeout):
            try:
                record = validate_record(raw, self.vocab_size, self.objective.feature_size)
            except RecordRefused as error:
                self.stats.refused[str(error).split(" ")[0]] += 1
                log.warning("refused a record: %s", error)
                continue
            if record.num_tokens < self.objective.min_tokens:
                self.stats.refused["too-short"] += 1
                continue
            self.stats.records_in += 1
            taken += 1
            # sampled records are held out too: they are evidence for the gate (see specd.learner.gate)
            if not self.gate.hold_out(record, self.stats.records_in):
                self.buffer.append(record)
        return taken

    @property
    def holdout(self) -> deque[TrajectoryRecord]:
        """The records held out for the gate, never trained on."""
        return self.gate.held_out

    # ---- training -------------------------------------------------------------------------
    def train_step(self) -> float:
        cfg = self.config
        buffered = list(self.buffer)
        recent = round(cfg.batch_size * cfg.recent_share)
        records = (self.rng.choices(buffered[-cfg.recent_records:], k=recent)
                   + self.rng.choices(buffered, k=cfg.batch_size - recent))
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16"):
            loss, num_tokens = self.objective.loss(self.model, records, self.rng)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.stats.steps += 1
        self.stats.tokens_trained += num_tokens
        self.stats.records_trained += len(records)
        value = float(loss.detach())
        self.stats.losses.append(value)
        self._note_staleness(records)
        return value

    @property
    def staleness(self) -> dict[str, Any]:
        """How old the last trained batch was: mean record age (s) and versions behind the live one."""
        return dict(self._staleness or {})

    def _note_staleness(self, records: list[TrajectoryRecord]) -> None:
        now = time.time()
        live = self.live_version or 0
        ages = [now - r.finished for r in records]
        behind = [live - int(s.version) for r in records for s in r.steps[:1] if s.version.isdigit()]
        self._staleness = {"mean_record_age_s": sum(ages) / len(ages),
                           "mean_versions_behind": sum(behind) / len(behind) if behind else None}

    def step(self) -> bool:
        """Take records, train one step if there is data, publish when due; True if it trained."""
        self.intake()
        if len(self.buffer) < self.config.min_records:
            return False
        begin = time.perf_counter()
        self.train_step()
        self.maybe_publish()
        spent = time.perf_counter() - begin
        self.stats.training_seconds += spent
        if self.config.duty_cycle < 1:
            self._stop.wait(spent * (1 - self.config.duty_cycle) / self.config.duty_cycle)
        return True

    # ---- gate and publishing --------------------------------------------------------------
    def _follow_external_change(self) -> bool:
        """An operator or the canary changed the live version: train on from it and hold publishing.
        True while publishing is held."""
        live = self.store.live_version()
        if live is None or live == self.live_version:
            return time.monotonic() < self._hold_until
        log.warning("live version changed to %s outside the learner; holding publications for %.0f s",
                    live, self.config.hold_after_rollback_s)
        self._adopt(live)
        self._hold_until = time.monotonic() + self.config.hold_after_rollback_s
        return True

    def _adopt(self, live: int | None) -> None:
        """Take `live` as the version last seen (the next promotion's compare-and-set is against it)
        and train on from its weights where they fit the learner's drafter."""
        self.live_version = live
        if live is None:
            return
        try:
            restored = load_drafter(self.store.weights_path(live), self.fingerprint,
                                    target_embedding=self.target_embedding)
        except (SpecdError, OSError) as error:  # e.g. deleted by hand: the gate will fail on it, visibly
            log.warning("cannot load live version %s (%s); training goes on from the learner's own", live, error)
            return
        if type(restored) is type(self.model) and restored.config == self.model.config:
            self.model.load_state_dict(restored.float().state_dict())
        else:
            log.warning("live version %s is another kind of drafter; training goes on from the learner's own", live)

    def maybe_publish(self, force: bool = False) -> int | None:
        cfg = self.config
        if self._follow_external_change() and not force:
            return None
        due = (self.stats.steps - self._steps_at_publish >= cfg.publish_every_steps
               or time.monotonic() - self._last_publish >= cfg.publish_every_seconds)
        if not (force or due) or self.stats.steps == self._steps_at_publish:
            return None
        self._steps_at_publish, self._last_publish = self.stats.steps, time.monotonic()
        if not self.gate.has_evidence:  # never a pass for lack of evidence: train on, try again when due
            self.stats.gate_waits += 1
            # logged once per stretch of waiting (due publications can come many times a second)
            log.log(logging.DEBUG if self._gate_waiting else logging.INFO,
                    "gate waits: %d held-out records, it needs %d (publications skipped: %d)",
                    len(self.holdout), self.config.gate_min_held_out, self.stats.gate_waits)
            self._gate_waiting = True
            return None
        self._gate_waiting = False
        seen = self.live_version  # what the candidate is compared with, and the condition of its promotion
        candidate = clone_drafter(self.model).eval()
        verdict = self.evaluate(candidate)
        info = {"evaluation": verdict, "records_trained": self.stats.records_trained,
                "tokens_trained": self.stats.tokens_trained, "learner_steps": self.stats.steps,
                "staleness": self._staleness}
        version = self._publish(candidate, info)
        if verdict["passed"] and not self._promote(version, seen):
            verdict = {**verdict, "passed": False, "reason": "the live version changed during the evaluation"}
        if verdict["passed"]:
            self.live_version = version
            self.stats.published.append({"version": version, **verdict})
            log.info("published drafter version %s: %s", version, verdict)
        else:
            self.store.update(version, status="rejected", reason=verdict["reason"], evaluation=verdict)
            self.stats.rejected.append({"version": version, **verdict})
            log.warning("gate rejected candidate %s: %s", version, verdict["reason"])
        self.store.gc()
        return version if verdict["passed"] else None

    def _promote(self, version: int, seen: int | None) -> bool:
        """Make a passed candidate live unless an operator or the canary changed the live version
        from `seen` while it was evaluated: theirs stands, and the learner follows it."""
        try:
            self.store.set_live(version, "gate passed", if_live=seen)
        except LiveVersionChanged:
            self._follow_external_change()
            return False
        return True

    def evaluate(self, candidate: DrafterModel) -> dict[str, Any]:
        """The gate's verdict on `candidate` against the live version the learner last saw."""
        return self.gate.verdict(candidate, self._live_model(), self.simulated_accept_length)

    def simulated_accept_length(self, model: DrafterModel, records: list[TrajectoryRecord]) -> float:
        """Tokens per target pass the drafter would reach on these records, greedy or sampled
        (an unbiased estimate on sampled ones: see `specd.learner.gate`)."""
        if type(model) is not type(self.model):  # a live version of another kind cannot be replayed here
            return 1.0
        return self.objective.simulate(model, records, self.config.k).accept_length or 0.0

    def _live_model(self, version: int | None = None) -> DrafterModel | None:
        version = self.live_version if version is None else version
        if version is None:
            return None
        return load_drafter(self.store.weights_path(version), self.fingerprint, target_embedding=self.target_embedding)

    # ---- versions from outside: an operator's POST /v1/live of a candidate ----------------------
    def submit(self, version: int) -> Future[dict[str, Any]]:
        """Put a version the learner did not train through the gate; it goes live (compare-and-set on
        the live version when it was evaluated) only if it passes. The verdict has `waiting` True
        when the gate lacks evidence. Runs on the learner's thread, which owns the objective's caches."""
        future: Future[dict[str, Any]] = Future()
        self._submitted.put((version, future))
        if self._thread is None or not self._thread.is_alive():  # no loop to hand it to
            self._vet_submitted()
        return future

    def _vet_submitted(self) -> None:
        while True:
            try:
                version, future = self._submitted.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._vet(version))
                except Exception as error:  # the caller gets it (a 4xx/5xx), the loop goes on
                    future.set_exception(error)

    def _vet(self, version: int) -> dict[str, Any]:
        if not self.gate.has_evidence:
            return {"passed": False, "waiting": True, "reason": f"the gate has {len(self.holdout)} held-out "
                    f"records and needs {self.config.gate_min_held_out}; try again later"}
        seen = self.store.live_version()
        candidate = load_drafter(self.store.weights_path(version), self.fingerprint,
                                 target_embedding=self.target_embedding)
        verdict = self.gate.verdict(candidate, self._live_model(seen), self.simulated_accept_length)
        if verdict["passed"]:
            try:
                self.store.set_live(version, "operator, gate passed", if_live=seen)
            except LiveVersionChanged:
                verdict = {**verdict, "passed": False, "reason": "the live version changed during the evaluation"}
        else:
            self.store.update(version, status="rejected", reason=verdict["reason"], evaluation=verdict)
        log.info("submitted version %s: %s", version, verdict)
        return verdict

    def _publish(self, model: DrafterModel, info: dict[str, Any]) -> int:
        serving_copy = clone_drafter(model).to(self.serving_dtype)
        return self.store.publish(serving_copy, self.fingerprint, self.live_version, info, self.target_embedding)

    # ---- thread ---------------------------------------------------------------------------
    def start(self) -> Learner:
        self._thread = threading.Thread(target=self._run, name="specd-learner", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        lower_thread_priority()  # training yields to decoding whenever both want a core
        while not self._stop.is_set():
            try:
                self._vet_submitted()
                if not self.step():
                    self.intake(timeout=0.2)
            except Exception as error:  # a learner bug must not take serving down with it, nor pass unseen
                self.stats.loop_failures += 1
                self.stats.last_failure = {"error": f"{type(error).__name__}: {error}", "time": time.time()}
                log.exception("learner step failed (%d failures so far); retrying in %.0f s",
                              self.stats.loop_failures, FAILURE_BACKOFF_S)
                self._stop.wait(FAILURE_BACKOFF_S)

    def health(self) -> dict[str, Any]:
        """For a status endpoint: is the thread running, its failures, and is the gate waiting for evidence."""
        return {"running": self._thread is not None and self._thread.is_alive(),
                "loop_failures": self.stats.loop_failures, "last_failure": self.stats.last_failure,
                "gate_waits": self.stats.gate_waits, "held_out_records": len(self.holdout),
                "gate_min_held_out": self.config.gate_min_held_out}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
