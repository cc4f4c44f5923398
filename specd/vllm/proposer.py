"""`SpecdProposer`: specd's drafter as vLLM's `custom_class` speculative proposer.

Contract: vLLM (0.32) builds it as `SpecdProposer(vllm_config)` in each worker, calls
`load_model(target_model)` once the target is loaded, then every step
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)` and takes
back 0..k greedy drafts per row (vLLM's rejection sampler treats drafts without probabilities
as deterministic, which keeps sampled decoding exact and greedy decoding identical to vLLM
alone). Inside `propose` it only reads vLLM's buffers and the runner's row -> request id map,
infers the previous step's accepted drafts, moves drafter slots to follow vLLM's rows, and
drafts; records, acceptance reports, MQTT and weight fetches all run on background threads.
New drafter versions arrive as specd's servers get them (retained MQTT announcements plus HTTP
from the learner, or a local store), are checked off the decoding thread and take over at the
start of a `propose`: no vLLM call, no pause. Settings come from `SPECD_*` environment
variables (see `launch.PluginSettings`).
"""

from __future__ import annotations

import logging
import queue
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specd.drafter.base import DraftBatch
from specd.drafter.factory import DrafterSpec, ServingDrafter, build_drafter, initial_model
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.token_drafter import TargetHead
from specd.drafter.traffic_table import TrafficTable
from specd.errors import CheckpointError
from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper, VersionSource
from specd.model.checkpoint import read_target_head
from specd.model.fingerprint import TargetFingerprint
from specd.mqtt import MqttPublisher
from specd.records import TrajectoryRecord
from specd.vllm.budget import DraftBudget, LearnedGate, ShadowBook
from specd.vllm.launch import PluginSettings
from specd.vllm.tracking import SlotTable, StepTracker, stop_index

log = logging.getLogger(__name__)


class PinnedSource:
    """A version source an operator can override: a forced version wins over announcements."""

    def __init__(self, inner: VersionSource, forced: int | None = None) -> None:
        self.inner = inner
        self.forced = forced

    def live_version(self) -> int | None:
        return self.forced if self.forced is not None else self.inner.live_version()

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        return self.inner.fetch(version)


def find_model_runner() -> Any:
    """vLLM's model runner, found up the call stack: it holds the row -> request id map we need."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "input_batch") and hasattr(candidate, "requests"):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


class SpecdProposer:
    def __init__(self, vllm_config: Any) -> None:
        self.settings = PluginSettings.from_env()
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_rows = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.target_dir = Path(str(vllm_config.model_config.model))
        if not (self.target_dir / "config.json").is_file():
            raise CheckpointError(f"specd's proposer needs the target as a local checkpoint folder; "
                                  f"{self.target_dir} has no config.json")
        self.runner: Any = None
        self.drafter: ServingDrafter | None = None
        self.swapper: Swapper | None = None
        self.source: PinnedSource | None = None
        self.publisher: MqttPublisher | None = None
        self.table: TrafficTable | None = None
        self.tracker = StepTracker(self.settings.server_id, self.settings.domain)
        self.slots = SlotTable(self.max_rows, self.max_rows)
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)  # the last finished records, for the control path
        self.num_steps = 0
        self.seconds_proposing = 0.0
        self.gate = LearnedGate()
        self.budget = DraftBudget(self.k)
        self.shadow = ShadowBook()
        self._step_seconds, self._emitted = 0.0, 0      # the last decode step's time and output
        self._sent: dict[str, str] = {}               # request id -> source of the drafts sent last step
        self.drafts_sent = self.drafts_withheld = 0
        self.learned_steps = 0
        self._last_call: float | None = None
        self._finished: queue.SimpleQueue[TrajectoryRecord] = queue.SimpleQueue()
        self._lock = threading.Lock()                  # tracker totals are read by the reporter thread

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self, target_model: Any) -> None:
        self.runner = find_model_runner()
        device = next(target_model.parameters()).device
        config, embed, head = read_target_head(self.target_dir)
        fingerprint = TargetFingerprint.of(config, self.target_dir)
        embed, head = embed.to(device), head.to(device)
        settings = self.settings
        inner: VersionSource
        if settings.store is not None:
            inner = LocalStore(WeightStore(settings.store))
        else:
            cache = Path(settings.cache or tempfile.mkdtemp(prefix="specd-vllm-"))
            inner = RemoteSource(cache / "fetched", settings.learner_url)
        if settings.mqtt is not None:
            announce = inner.announce if isinstance(inner, RemoteSource) else None
            self.publisher = MqttPublisher(settings.mqtt, settings.server_id, on_announcement=announce).start()
        self.source = PinnedSource(inner, settings.version)
        spec = DrafterSpec(settings.drafter_kind, settings.drafter_layers, settings.drafter_head_vocab,
                           settings.traffic_table)
        # version "0" serves until the live version is loaded, a moment after start
        self.drafter = build_drafter(spec, initial_model(TargetHead(config, embed, head), spec), "0")
        self.table = getattr(self.drafter, "table", None)
        self.drafter.bind(self.slots.capacity, self.max_model_len + self.k + 1, device)
        self.swapper = Swapper(self.source, self.drafter, fingerprint, target_embedding=embed)
        self.swapper.check_once()  # a local store's live version serves from the first step
        self.swapper.start()
        # both live as long as vLLM's worker process (daemon threads, nothing to shut down)
        for target, name in ((self._publish_records, "specd-vllm-records"), (self._report_loop, "specd-vllm-reports")):
            threading.Thread(target=target, name=name, daemon=True).start()
        log.info("specd proposer ready: k=%d, %d rows, drafter %s, version source %s", self.k, self.max_rows,
                 settings.drafter_kind, type(inner).__name__)

    # ---- the decoding thread ----------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        begin = time.perf_counter()
        assert self.drafter is not None, "vLLM called propose before load_model"
        if self.runner is None:
            self.runner = find_model_runner()
            if self.runner is None:
                raise RuntimeError("specd's proposer cannot find vLLM's model runner (its row -> request id map); "
                                   "it is tested with vLLM 0.32")
        rows = len(sampled_token_ids)
        request_ids = [str(r) for r in self.runner.input_batch.req_ids[:rows]]
        lengths = np.asarray(num_tokens_no_spec[:rows])
        prompt_lengths = np.asarray(self.runner.input_batch.num_prompt_tokens[:rows])
        with self._lock:
            accepted = self.tracker.observe(request_ids, sampled_token_ids, lengths, prompt_lengths,
                                            token_ids_cpu, self.drafter.version)
        if accepted:  # the previous proposal's rows are still in their slots: settle them first
            self.drafter.commit(torch.tensor(accepted))
        self._observe_costs(request_ids, sampled_token_ids, begin)
        if rows == 0:
            self.tracker.previous_rows = []
            self._close_finished(request_ids, sampled_token_ids)
            return []
        self.slots.arrange(request_ids, self.drafter)
        device = self.drafter.model.embed.weight.device
        batch = DraftBatch(tokens=torch.from_numpy(token_ids_cpu[:rows]).to(device),
                           lengths=torch.from_numpy(lengths.astype(np.int64)).to(device),
                           prompt_lengths=prompt_lengths.tolist(), request_ids=request_ids,
                           temperature=torch.zeros(rows, device=device), top_p=torch.ones(rows, device=device),
                           generators=[])
        if isinstance(self.drafter, HybridDrafter):
            self.drafter.use_learned = self.gate.decide()
            self.learned_steps += self.drafter.use_learned
        proposal = self.drafter.propose(batch, self.k)
        drafts_table = proposal.drafts.tolist()
        limits = proposal.limits.tolist() if proposal.limits is not None else [self.k] * rows
        sources = getattr(self.drafter, "row_sources", None) or ["learned"] * rows
        drafts = []
        self._sent = {}
        self.budget.rows = rows
        learned_expected = 0.0
        for row in range(rows):
            room = self.max_model_len - 1 - int(lengths[row])  # vLLM never verifies past max_model_len
            usable = max(min(int(limits[row]), room), 0) if sampled_token_ids[row] else 0
            worth = self.budget.keep(sources[row], usable)
            self.drafts_sent += worth
            self.drafts_withheld += usable - worth
            drafts.append(drafts_table[row][:worth])
            if worth == usable > 0:  # verification will tell how they fared
                self._sent[request_ids[row]] = sources[row]
            elif worth < usable:     # held back (some or all): scored against what the target produces
                self.shadow.add(request_ids[row], sources[row], int(lengths[row]), drafts_table[row][:usable])
            if sources[row] == "learned":
                learned_expected += self.budget.expected_accepted("learned", worth)
        if isinstance(self.drafter, HybridDrafter) and self.drafter.learned_ran:
            self.gate.observe(learned_expected, self._emitted, self.drafter.learned_seconds, self._step_seconds)
        with self._lock:
            self.tracker.remember(request_ids, drafts, lengths, self.drafter.version)
        self._close_finished(request_ids, sampled_token_ids)
        self.num_steps += 1
        self.seconds_proposing += time.perf_counter() - begin
        return drafts

    def _observe_costs(self, request_ids: list[str], sampled: list[list[int]], begin: float) -> None:
        """Feed the draft budget: each verified row's outcome, and this step's time against its size."""
        for request_id in request_ids:
            trajectory = self.tracker.live.get(request_id)
            scored = self.shadow.score(request_id, trajectory.tokens) if trajectory is not None else None
            if scored is not None:
                self.budget.observe_drafts(*scored)
        verified_drafts = {}
        for request_id, drafted, accepted in self.tracker.last_verified:
            verified_drafts[request_id] = drafted
            source = self._sent.get(request_id)
            if source is not None:
                self.budget.observe_drafts(source, drafted, accepted)
        previous, self._last_call = self._last_call, begin
        # a step that also prefilled a prompt is not a decode step: its time says nothing about drafts
        steady = previous is not None and all(sampled) and set(request_ids) <= set(self.tracker.previous_rows)
        if steady and previous is not None:
            verified = sum(1 + verified_drafts.get(request_id, 0) for request_id in request_ids)
            self._step_seconds, self._emitted = begin - previous, sum(len(s) for s in sampled)
            self.budget.observe_step(self._step_seconds, verified, self._emitted, len(request_ids))

    def _close_finished(self, request_ids: list[str], sampled: list[list[int]]) -> None:
        """Hand finished requests to the record thread: stopped this step, or gone from vLLM."""
        requests = self.runner.requests
        for row, request_id in enumerate(request_ids):
            state = requests.get(request_id)
            params = getattr(state, "sampling_params", None)
            trajectory = self.tracker.live.get(request_id)
            if params is None or trajectory is None or not sampled[row]:
                continue
            stop_ids = set(params.stop_token_ids or ())
            if getattr(params, "eos_token_id", None) is not None:
                stop_ids.add(int(params.eos_token_id))
            output = trajectory.tokens[len(trajectory.prompt_ids):]
            keep = stop_index(output, params.max_tokens, stop_ids, self.max_model_len - len(trajectory.prompt_ids),
                              trajectory.stop_checked)
            trajectory.stop_checked = len(output)
            if keep is not None:
                self._finish(request_id, keep, params)
        gone = [request_id for request_id in self.tracker.live if request_id not in requests]
        for request_id in gone:  # aborted, stopped by a stop string, or otherwise ended by vLLM
            self._finish(request_id, None, None)

    def _finish(self, request_id: str, keep: int | None, params: Any) -> None:
        sampling = {"temperature": getattr(params, "temperature", 0.0), "top_p": getattr(params, "top_p", 1.0)}
        with self._lock:
            record = self.tracker.finish(request_id, keep, sampling)
        self.slots.release(request_id)
        self.shadow.drop(request_id)
        if record is not None:
            self._finished.put(record)

    # ---- background threads -----------------------------------------------------------------
    def _publish_records(self) -> None:
        while True:
            record = self._finished.get()
            if self.table is not None:  # learned the moment a request ends, off the decoding thread
                self.table.add(record.prompt_ids + record.output_ids)
            payload = record.to_dict()
            self.recent.append(payload)
            if self.publisher is not None:
                self.publisher.publish(payload)  # bounded buffer: never blocks

    def _report_loop(self) -> None:
        while True:
            time.sleep(self.settings.report_seconds)
            if self.publisher is None:
                continue
            with self._lock:
                report = self.tracker.report()
            if report.versions:
                self.publisher.report(report.to_dict())

    def status(self) -> dict[str, Any]:
        """What the control path (`collective_rpc`) shows an operator."""
        with self._lock:
            report = self.tracker.report()
            live_requests = len(self.tracker.live)
        return {"server_id": self.settings.server_id, "version": self.drafter.version if self.drafter else None,
                "prepared_version": self.swapper.prepared_version if self.swapper else None,
                "forced_version": self.source.forced if self.source else None,
                "source_live_version": self.source.inner.live_version() if self.source else None,
                "k": self.k, "drafter": self.settings.drafter_kind, "steps": self.num_steps,
                "mean_propose_ms": 1000 * self.seconds_proposing / max(self.num_steps, 1),
                "live_requests": live_requests, "learned_drafter_steps": self.learned_steps,
                "learned_gain": self.gate.gain, "learned_cost": self.gate.cost,
                "draft_bar": self.budget.bar, "drafts_sent": self.drafts_sent,
                "drafts_withheld": self.drafts_withheld,
                "acceptance_by_source": {src: [round(a, 3) for a in self.budget.alpha(src)]
                                         for src in sorted(self.budget.reached)},
                "traffic_table_contexts": len(self.table) if self.table is not None else None,
                "traffic_table_rows": getattr(self.drafter, "num_table_rows", 0),
                "swaps": self.drafter.num_swaps if self.drafter else 0,
                "refused_versions": dict(self.swapper.refused) if self.swapper else {},
                "broker_connected": self.publisher.connected.is_set() if self.publisher else None,
                "records_published": self.publisher.counters.published if self.publisher else 0,
                "totals": report.to_dict()["versions"]}

    def force_version(self, version: int | None) -> dict[str, Any]:
        """Serve `version` regardless of announcements (None: follow them again); it takes over within a poll."""
        if self.source is None or self.swapper is None:
            raise RuntimeError("the proposer is not loaded yet")
        self.source.forced = version
        self.swapper.check_once()
        return self.status()
