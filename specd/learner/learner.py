"""The asynchronous learner: intake, training, the gate and promotion, composed and run as a loop.

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
a candidate if records arrived since the last one (an idle learner trains on, offering nothing
new), but only once at least `gate_min_held_out` records are held out: until then the
learner publishes nothing, counts the wait (`stats.gate_waits`) and trains on. A candidate is
published and made live if its simulated accept length on the held-out records is not worse than
the live version's, nor the bar's (the last version that improved without the margin), by more
than `gate_margin` and its weights are finite, rejected (with the
reason in its manifest) otherwise. An operator's candidate (`submit`) is judged by the same gate
on a worker thread of its own at serving priority, so its verdict never queues behind training,
and training steps aside (between steps) until it is answered.
Promotion is a compare-and-set against the live version the learner last saw: if an operator or
the canary changed it meanwhile, theirs stands, the learner trains on from it and publishes
nothing for `hold_after_rollback_s`. `duty_cycle` caps the share of wall time spent training, so a
learner beside serving leaves the cores to decoding. The thread survives any Exception in a step:
it is logged with its traceback, counted (`stats.loop_failures`, `stats.last_failure`, both in
`health()`), and the loop backs off a second.
The jobs live in their own modules: `intake`, `trainer`, `gate`, `promotion` and `supervision`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from specd.core.records import TrajectoryRecord
from specd.core.threads import CallWorker
from specd.drafter.checkpoint import DrafterModel, clone_drafter
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig, LearnerStats
from specd.learner.gate import Gate
from specd.learner.intake import Intake
from specd.learner.promotion import Promoter
from specd.learner.ranks import RankGroup, leave_group_on_failure
from specd.learner.shadow import ShadowCanary
from specd.learner.supervision import SupervisedLoop
from specd.learner.trainer import Trainer
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer
from specd.transport.bus import Bus

FAILURE_BACKOFF_S = 1.0  # after a failed step: a persistent fault is retried once a second, not in a hot loop
OPERATOR_PRIORITY_WAIT_S = 60.0  # the longest training steps aside for an operator's pending verdict


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


class Learner(SupervisedLoop):
    def __init__(self, config: LearnerConfig, bus: Bus, store: WeightStore, initial: DrafterModel,
                 fingerprint: TargetFingerprint, serving_dtype: torch.dtype = torch.float32,
                 target_embedding: torch.Tensor | None = None, target: Transformer | None = None,
                 group: RankGroup | None = None) -> None:
        self.stats = LearnerStats()
        self.group = group
        self.is_root = group is None or group.is_root  # the one that judges, publishes and answers operators
        super().__init__("specd-learner", self.stats, FAILURE_BACKOFF_S)
        self.config, self.bus, self.store = config, bus, store
        # the trainer is built from what the promoter finds live; it then trains on from what the promoter adopts
        self.promoter = Promoter(config, store, fingerprint, serving_dtype, target_embedding, self.stats,
                                 take_weights=lambda restored: self.trainer.take_weights(restored))
        if self.promoter.live_version is not None:  # a restarted learner resumes from what is serving
            initial = self.promoter.load(self.promoter.live_version)
        self.started_from = self.promoter.live_version
        if group is not None:
            self.promoter.origin = {"rank": group.info.rank}
            group.report(started_from=self.started_from)
        self.trainer = Trainer(clone_drafter(initial).float().train(), config, target, group)
        self.model, self.objective, self.optimizer = self.trainer.model, self.trainer.objective, self.trainer.optimizer
        self.gate = Gate(config.holdout_every, config.holdout_capacity, config.gate_min_held_out, config.gate_margin,
                         config.gate_traffic_window, config.gate_confidence_z)
        self.holdout = self.gate.held_out  # the records held out for the gate, never trained on
        self.canary = ShadowCanary(store, self.promoter.load, lambda m, r: self.simulated_accept_length(m, r),
                                   config.canary_margin, config.canary_min_records, config.canary_z,
                                   config.canary_every) if config.canary and self.is_root else None
        self._intake = Intake(initial.config.vocab_size, self.objective, self.gate, self.trainer.buffer_capacity,
                              self.stats, self.canary.observe if self.canary is not None else None)
        self.buffer = self._intake.buffer
        # RecordRefused for a raw record intake would refuse; callable from any thread (the sidecar's loop)
        self.check_record = self._intake.check
        if self.is_root:
            self.promoter.begin(self.model)
        # built here, on the constructing thread: not the reniced training loop's priority
        self._operator_calls = CallWorker("specd-operator-gate")

    @property
    def live_version(self) -> int | None:
        """The live version the learner last saw: its next promotion's compare-and-set is against it."""
        return self.promoter.live_version

    @property
    def staleness(self) -> dict[str, Any]:
        return self.trainer.staleness

    def intake(self, timeout: float = 0.0) -> int:
        return self._intake.take(self.bus, timeout)

    def train_step(self) -> float:
        return self.trainer.step(self.trainer.batch(self.buffer), self.stats, self.live_version)

    def step(self) -> bool:
        """Take records, train one step if there is data, publish when due; True if it trained.
        With ranks, every rank steps together (all have data, or none trains) and syncs after
        the step: held-out records to rank 0, which alone publishes (`specd.learner.ranks`)."""
        self.intake()
        ready = len(self.buffer) >= self.config.min_records
        if self.group is not None:
            ready = self.group.all_ready(ready)
        if not ready:
            return False
        # an operator's verdict has priority: training steps aside until it is answered (bounded,
        # so a verdict that hangs cannot stop learning)
        self._operator_calls.wait_idle(timeout=OPERATOR_PRIORITY_WAIT_S)
        begin = time.perf_counter()
        self.train_step()
        if self.group is not None:
            handed = [] if self.is_root else self.gate.drain()
            self.gate.keep(self.group.sync(handed, self.trainer.weights_epoch, self.model, self.stats,
                                           adopted=self.trainer.reanchor))
        if self.is_root:
            self.maybe_publish()
        spent = time.perf_counter() - begin
        self.stats.training_seconds += spent
        if self.config.duty_cycle < 1:
            self._stop.wait(spent * (1 - self.config.duty_cycle) / self.config.duty_cycle)
        return True

    def tick(self) -> None:
        with leave_group_on_failure(self.group):  # a rank that fails a step cannot rejoin the collectives
            if not self.step():
                self.intake(timeout=0.2)
        if self.canary is not None:
            # the canary's replays, like training, wait while an operator's verdict is pending
            self._operator_calls.wait_idle(timeout=OPERATOR_PRIORITY_WAIT_S)
            self.canary.check()

    def maybe_publish(self, force: bool = False) -> int | None:
        """Offer the trained drafter when due (or `force`d) and the gate has evidence; the version
        it published and made live, or None."""
        if self.promoter.held() and not force:
            return None
        if not self.promoter.due(self.gate, force):
            return None
        seen = self.live_version  # what the candidate is compared with, and the condition of its promotion
        candidate = clone_drafter(self.model).eval()
        version = self.promoter.offer(candidate, self.evaluate(candidate), seen, self.trainer.staleness or None)
        if version is not None:
            self.trainer.version_went_live()
        return version

    def evaluate(self, candidate: DrafterModel) -> dict[str, Any]:
        """The gate's verdict on `candidate` against the live version the learner last saw and the bar."""
        verdict = self.gate.verdict(candidate, self.promoter.live_model(), self.simulated_accept_length,
                                    bar=self.promoter.bar_model())
        return {**verdict, "replay_k": self.config.k}  # the drafts a step the replay drafted: not what servers chose

    def simulated_accept_length(self, model: DrafterModel, records: list[TrajectoryRecord]) -> float:
        """Tokens per target pass the drafter would reach on these records, greedy or sampled
        (how sampled ones are judged: see `specd.learner.gate`)."""
        return self.trainer.accept_length(model, records)

    def submit(self, version: int) -> Future[dict[str, Any]]:
        """Put a version the learner did not train (an operator's POST /v1/live) through the gate; it
        goes live only if it passes. The verdict has `waiting` True when the gate lacks evidence.
        Runs on the operator worker, beside training: the gate's held-out set and the objective's
        feature cache are locked, and promotion is a compare-and-set in the store."""
        return self._operator_calls.submit(lambda: self.promoter.vet(version, self.gate, self.simulated_accept_length))

    def health(self) -> dict[str, Any]:
        """For a status endpoint: is the thread running, its failures, and is the gate waiting for evidence."""
        return {"running": self.running,
                "loop_failures": self.stats.loop_failures, "last_failure": self.stats.last_failure,
                "skipped_steps": self.stats.skipped_steps, "gate_waits": self.stats.gate_waits,
                "held_out_records": len(self.holdout),
                "canary_rollbacks": len(self.canary.rollbacks) if self.canary is not None else None,
                "gate_min_held_out": self.config.gate_min_held_out}
