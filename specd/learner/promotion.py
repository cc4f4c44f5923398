"""Promotion: how a judged candidate becomes the live version, and the learner's view of what is live.

Contract: `promote` is the one way a version the gate judged goes live or is marked rejected, for
the learner's own candidates and for an operator's submissions alike: a passed verdict makes it
live by compare-and-set against the live version `seen` when it was judged; if someone changed
the live version meanwhile, theirs stands and the verdict fails with `RACE_LOST`. A failed
verdict marks the version rejected with its reason (a lost race too, where `reject_lost_race`).

`Promoter` keeps what the learner last saw live (the condition of its next promotion), the gate's
bar (`bar_version`: the last version that went live without needing the gate's margin; it follows
the live version wherever an operator or the canary sets it) and the publishing cadence:
a candidate is due every `publish_every_steps` steps or
`publish_every_seconds` seconds; after an operator or the canary changes the live version, the
learner trains on from theirs (`adopt`) and offers nothing for `hold_after_rollback_s`. Day 0
publishes the untrained drafter as version 1 unless something is live already.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from specd.core.errors import SpecdError
from specd.core.records import TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel, clone_drafter, load_drafter
from specd.hotswap.store import LiveVersionChanged, WeightStore
from specd.learner.config import LearnerConfig, LearnerStats
from specd.learner.gate import Gate
from specd.model.fingerprint import TargetFingerprint

log = logging.getLogger(__name__)

RACE_LOST = "the live version changed during the evaluation"
AcceptLength = Callable[[DrafterModel, list[TrajectoryRecord]], float]
TakeWeights = Callable[[DrafterModel], bool]


INITIAL, GATE_PASSED = "initial", "gate passed"   # why the learner's own versions went live
OWN_REASONS = (INITIAL, GATE_PASSED)   # any other reason: someone else set it (a rollback, an operator)


def hold_left_at_start(store: WeightStore, live: int | None, hold_s: float) -> float:
    """The monotonic time a learner (re)started soon after someone else set the live version (an
    operator's rollback) holds its publications until: what is left of `hold_s` after it (the hold
    lived in the stopped process's memory, and a restart published over a rollback 40 s after it).
    0 when its own version is live or the hold has run out."""
    if live is None:
        return 0.0
    try:
        manifest = store.manifest(live)
    except (SpecdError, OSError, ValueError):
        return 0.0
    since = manifest.get("live_since")
    if manifest.get("live_reason") in OWN_REASONS or not isinstance(since, int | float):
        return 0.0
    left = since + hold_s - time.time()
    if left <= 0:
        return 0.0
    log.warning("version %s went live %.0f s ago (%s); holding publications for the %.0f s left",
                live, time.time() - since, manifest.get("live_reason"), left)
    return time.monotonic() + left


def promote(store: WeightStore, version: int, verdict: dict[str, Any], seen: int | None, why: str,
            reject_lost_race: bool = True) -> dict[str, Any]:
    """Make `version` live if `verdict` passed and the live version is still `seen`; else mark it
    rejected (a lost race only where `reject_lost_race`). Returns the final verdict."""
    if verdict["passed"]:
        try:
            store.set_live(version, why, if_live=seen)
            return verdict
        except LiveVersionChanged:
            verdict = {**verdict, "passed": False, "reason": RACE_LOST}
            if not reject_lost_race:
                return verdict
    store.update(version, status="rejected", reason=verdict["reason"], evaluation=verdict)
    return verdict


class HeldVersion:
    """One version's model, kept while that version is the one asked for (versions are immutable):
    the gate compares against it verdict after verdict without a reload each time. The training
    loop and the operator worker both ask, hence the lock; the old copy goes before the new one is
    read, so that at most one is held."""

    def __init__(self, load: Callable[[int], DrafterModel]) -> None:
        self._load = load
        self._held: tuple[int, DrafterModel] | None = None
        self._lock = threading.Lock()

    def get(self, version: int) -> DrafterModel:
        with self._lock:
            if self._held is None or self._held[0] != version:
                self._held = None
                self._held = (version, self._load(version))
            return self._held[1]

    def drop(self) -> None:
        with self._lock:
            self._held = None

    @property
    def model(self) -> DrafterModel | None:
        held = self._held
        return None if held is None else held[1]


class Promoter:
    def __init__(self, config: LearnerConfig, store: WeightStore, fingerprint: TargetFingerprint,
                 serving_dtype: torch.dtype, target_embedding: torch.Tensor | None, stats: LearnerStats,
                 take_weights: TakeWeights) -> None:
        self.config, self.store, self.fingerprint, self.stats = config, store, fingerprint, stats
        self.take_weights = take_weights  # trains on from an adopted live version, where it fits
        self.serving_dtype = serving_dtype
        self.target_embedding = target_embedding  # versions that keep it frozen reference it, not copy it
        self.live_version = store.live_version()
        self._last_publish = time.monotonic()
        self._steps_at_publish = 0
        self._records_at_publish = 0
        self._hold_until = hold_left_at_start(store, self.live_version, config.hold_after_rollback_s)
        self._gate_waiting = False
        self._live_copy = HeldVersion(self.load)
        self.bar_version = self.live_version
        self._bar_copy = HeldVersion(self.load)
        self.origin: dict[str, Any] = {}  # added to every manifest it publishes (e.g. the publishing rank)

    def load(self, version: int) -> DrafterModel:
        return load_drafter(self.store.weights_path(version), self.fingerprint, target_embedding=self.target_embedding)

    def live_model(self, version: int | None = None) -> DrafterModel | None:
        """The live version's model for the gate to compare against (one copy, see `HeldVersion`).
        The gate only reads it; training never gets this copy (`adopt` loads its own)."""
        version = self.live_version if version is None else version
        return None if version is None else self._live_copy.get(version)

    def bar_model(self) -> DrafterModel | None:
        """The bar version's model for the gate, None while the bar is the live version itself."""
        version = self.bar_version
        if version is None or version == self.live_version:
            self._bar_copy.drop()
            return None
        return self._bar_copy.get(version)

    @property
    def gate_copies(self) -> list[DrafterModel]:
        """The models held for the gate (the live version's and the bar's, where held), for the
        learner's memory breakdown."""
        return [model for model in (self._live_copy.model, self._bar_copy.model) if model is not None]

    def publish(self, model: DrafterModel, info: dict[str, Any]) -> int:
        serving_copy = clone_drafter(model).to(self.serving_dtype)
        return self.store.publish(serving_copy, self.fingerprint, self.live_version, {**info, **self.origin},
                                  self.target_embedding)

    def begin(self, model: DrafterModel) -> None:
        """Day 0: the untrained drafter is version 1, live while nothing else is."""
        if self.live_version is not None:
            return
        first = self.publish(model, {"evaluation": None, "reason": INITIAL})
        try:
            self.store.set_live(first, INITIAL, if_live=None)
            self.live_version = self.bar_version = first
        except LiveVersionChanged:  # another learner or an operator was first: resume from theirs
            self.adopt(self.store.live_version())

    def adopt(self, live: int | None) -> None:
        """Take `live` as the version last seen (the next promotion's compare-and-set is against it)
        and train on from its weights where they fit the learner's drafter; it is the gate's bar now."""
        self.live_version = self.bar_version = live
        if live is None:
            return
        try:
            restored = self.load(live)
        except (SpecdError, OSError) as error:  # e.g. deleted by hand: the gate will fail on it, visibly
            log.warning("cannot load live version %s (%s); training goes on from the learner's own", live, error)
            return
        if not self.take_weights(restored):
            log.warning("live version %s is another kind or shape of drafter (or drafts another vocabulary); "
                        "training goes on from the learner's own", live)

    def held(self) -> bool:
        """Follow a live version an operator or the canary set: True while publishing is held."""
        live = self.store.live_version()
        if live is None or live == self.live_version:
            return time.monotonic() < self._hold_until
        log.warning("live version changed to %s by a rollback or an operator, not by the gate; holding "
                    "publications for %.0f s", live, self.config.hold_after_rollback_s)
        self.adopt(live)
        self._hold_until = time.monotonic() + self.config.hold_after_rollback_s
        return True

    def due(self, gate: Gate, force: bool) -> bool:
        """Is a candidate due now, with evidence for the gate? Counts and logs a wait for evidence.
        Not without records taken since the last one: a learner with no traffic trains on over the
        same records, and offering that every 15 s made a new live version every 15 s on an idle
        server (an operator's rollback scrolled out of sight and gc took its evidence)."""
        cfg = self.config
        steps = self.stats.steps
        on_time = (steps - self._steps_at_publish >= cfg.publish_every_steps
                   or time.monotonic() - self._last_publish >= cfg.publish_every_seconds)
        records = self.stats.records_in + gate.kept_from_ranks  # with ranks, theirs reach rank 0 held out
        if not (force or (on_time and records > self._records_at_publish)) or steps == self._steps_at_publish:
            return False
        self._steps_at_publish, self._last_publish = steps, time.monotonic()
        self._records_at_publish = records
        if not gate.has_evidence:  # never a pass for lack of evidence: train on, try again when due
            self.stats.gate_waits += 1
            # logged once per stretch of waiting (due publications can come many times a second)
            log.log(logging.DEBUG if self._gate_waiting else logging.INFO,
                    "gate waits: %d held-out records, it needs %d (publications skipped: %d)",
                    len(gate.held_out), cfg.gate_min_held_out, self.stats.gate_waits)
            self._gate_waiting = True
            return False
        self._gate_waiting = False
        return True

    def offer(self, candidate: DrafterModel, verdict: dict[str, Any], seen: int | None,
              staleness: dict[str, Any] | None) -> int | None:
        """Publish the learner's judged candidate and promote it; its version if it went live."""
        info = {"evaluation": verdict, "records_trained": self.stats.records_trained,
                "tokens_trained": self.stats.tokens_trained, "learner_steps": self.stats.steps,
                "staleness": staleness}
        self.store.gc()  # first too: on a full disk, what gc frees is what the new version needs
        version = self.publish(candidate, info)
        verdict = promote(self.store, version, verdict, seen, GATE_PASSED)
        if verdict["passed"]:
            self.live_version = version
            if verdict.get("improved", True):
                self.bar_version = version
            self.stats.published.append({"version": version, **verdict})
            log.info("published drafter version %s: %s", version, verdict)
        else:
            if verdict["reason"] == RACE_LOST:
                self.held()
            self.stats.rejected.append({"version": version, **verdict})
            log.warning("gate rejected candidate %s: %s", version, verdict["reason"])
        self.store.gc()
        return version if verdict["passed"] else None

    def vet(self, version: int, gate: Gate, accept_length: AcceptLength) -> dict[str, Any]:
        """An operator's submission of a version the learner did not train: through the gate, and
        live only if it passes (a lost race leaves it as it was, for the operator to retry). It is
        measured from the live version alone, not the bar: the operator chose it, and once live it
        is the bar."""
        if not gate.has_evidence:
            return {"passed": False, "waiting": True, "reason": f"the gate has {len(gate.held_out)} held-out "
                    f"records and needs {self.config.gate_min_held_out}; try again later"}
        seen = self.store.live_version()
        verdict = {**gate.verdict(self.load(version), self.live_model(seen), accept_length), "replay_k": self.config.k}
        verdict = promote(self.store, version, verdict, seen, "operator, gate passed", reject_lost_race=False)
        log.info("submitted version %s: %s", version, verdict)
        return verdict
