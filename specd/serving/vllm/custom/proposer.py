"""`SpecdProposer`: specd's token-level hybrid drafter as vLLM's `custom_class` proposer (the custom route).

Contract: vLLM (0.32) builds it as `SpecdProposer(vllm_config)` in each worker, calls
`load_model(target_model)` once the target is loaded, then every step
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)` and takes
back 0..k greedy drafts per row (vLLM's rejection sampler treats drafts without probabilities
as deterministic, which keeps sampled decoding exact and greedy decoding identical to vLLM
alone). `propose` only reads vLLM's buffers and the runner's row -> request id map, in four
steps: observe (the `StepTracker` infers the previous step's accepted drafts, the drafter
commits them, the `DraftPolicy` learns from them), draft (the `SlotTable` moves drafter slots
to follow vLLM's rows, the drafter proposes, with the learned part on or off as the policy's
gate says), choose (the policy picks the drafts worth verifying) and remember (the tracker
keeps what was sent; finished requests become records for `Telemetry`). Records, acceptance
reports and MQTT run on telemetry's threads, weight fetches on the swapper's. New drafter
versions arrive as specd's servers get them (retained MQTT announcements plus HTTP from the
learner, or a local store), are checked off the decoding thread and take over at the start of
a `propose`: no vLLM call, no pause. Settings come from `SPECD_*` environment variables (see
`launch.PluginSettings`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specd.core.errors import CheckpointError
from specd.core.records import LEARNED_SOURCE
from specd.drafter.base import BUILT_IN_VERSION, DraftBatch
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.swap import ServingDrafter
from specd.drafter.token_drafter import TargetHead
from specd.hotswap.swapper import Swapper
from specd.model.fingerprint import TargetFingerprint
from specd.model.loading import read_target_head
from specd.serving.vllm.shared.budget import DraftBudget
from specd.serving.vllm.shared.launch import PluginSettings
from specd.serving.vllm.shared.policy import Candidates, DraftPolicy
from specd.serving.vllm.shared.tracking import SlotTable
from specd.serving.vllm.shared.worker_loop import (
    PinnedSource,
    RequestBook,
    StepFaults,
    find_model_runner,
    follow_versions,
    force_version,
)

log = logging.getLogger(__name__)


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
        self.book = RequestBook(self.settings, self.max_model_len)
        self.tracker, self.telemetry = self.book.tracker, self.book.telemetry
        self.slots = SlotTable(self.max_rows, self.max_rows)
        self.policy = DraftPolicy(DraftBudget(self.k), self.max_model_len)
        self.num_steps = 0
        self.faults = StepFaults()
        self.seconds_proposing = 0.0

    @property
    def recent(self) -> deque[dict[str, Any]]:
        """The last finished records, newest last (the control path shows them)."""
        return self.telemetry.recent

    # ---- set-up ---------------------------------------------------------------------------
    def load_model(self, target_model: Any) -> None:
        self.runner = find_model_runner()
        device = next(target_model.parameters()).device
        config, embed, head = read_target_head(self.target_dir)
        fingerprint = TargetFingerprint.of(config, self.target_dir)
        embed, head = embed.to(device), head.to(device)
        settings = self.settings
        self.source, publisher = follow_versions(settings)
        # the custom route serves the token-level drafter: custom_class is given no hidden states
        # (the feature drafter runs on the eagle3 route, see specd.serving.vllm.eagle3.companion)
        spec = DrafterSpec(settings.drafter_kind, arch="token", layers=settings.drafter_layers,
                           head_vocab=settings.drafter_head_vocab, traffic_table=settings.traffic_table)
        # the built-in version serves until the live version is loaded, a moment after start
        self.drafter = build_drafter(spec, initial_model(TargetHead(config, embed, head), spec), BUILT_IN_VERSION)
        self.drafter.bind(self.slots.capacity, self.max_model_len + self.k + 1, device)
        self.swapper = Swapper(self.source, self.drafter, fingerprint, target_embedding=embed)
        self.swapper.check_once()  # a local store's live version serves from the first step
        self.swapper.start()
        self.telemetry.start(publisher, self.drafter.table if isinstance(self.drafter, HybridDrafter) else None)
        log.info("specd proposer ready: k=%d, %d rows, drafter %s, version source %s", self.k, self.max_rows,
                 settings.drafter_kind, type(self.source.inner).__name__)

    # ---- the decoding thread ----------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        """Drafts per row; a fault in specd's part leaves the step without drafts (see `StepFaults`)."""
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as error:
            self.faults.note(error, self.book)
            return [[] for _ in sampled_token_ids]

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray) -> list[list[int]]:
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
        self._observe(request_ids, sampled_token_ids, lengths, prompt_lengths, token_ids_cpu, begin)
        if rows == 0:  # nothing to draft for, but requests may have ended
            self._remember([], [], lengths, sampled_token_ids)
            return []
        candidates = self._draft(request_ids, lengths, prompt_lengths, token_ids_cpu)
        drafts = self.policy.choose(request_ids, candidates, lengths, sampled_token_ids)
        self._remember(request_ids, drafts, lengths, sampled_token_ids, candidates.sources)
        self.num_steps += 1
        self.seconds_proposing += time.perf_counter() - begin
        return drafts

    def _observe(self, request_ids: list[str], sampled: list[list[int]], lengths: np.ndarray,
                 prompt_lengths: np.ndarray, token_ids_cpu: np.ndarray, begin: float) -> None:
        """The previous step's outcome: to the tracker, the drafter's caches and the policy."""
        assert self.drafter is not None
        accepted = self.book.observe(request_ids, sampled, lengths, prompt_lengths, token_ids_cpu,
                                     self.drafter.version)
        if accepted:  # the previous proposal's rows are still in their slots: settle them first
            self.drafter.commit(torch.tensor(accepted))
        self.policy.observe(request_ids, sampled, self.tracker, begin)

    def _draft(self, request_ids: list[str], lengths: np.ndarray, prompt_lengths: np.ndarray,
               token_ids_cpu: np.ndarray) -> Candidates:
        """k drafts per row from the drafter, its slots first arranged to match vLLM's rows."""
        drafter, rows = self.drafter, len(request_ids)
        assert drafter is not None
        self.slots.arrange(request_ids, drafter)
        device = next(drafter.model.parameters()).device
        batch = DraftBatch(tokens=torch.from_numpy(token_ids_cpu[:rows]).to(device),
                           lengths=torch.from_numpy(lengths.astype(np.int64)).to(device),
                           prompt_lengths=prompt_lengths.tolist(), request_ids=request_ids,
                           temperature=torch.zeros(rows, device=device), top_p=torch.ones(rows, device=device),
                           generators=[])
        if isinstance(drafter, HybridDrafter):
            drafter.use_learned = self.policy.use_learned()
        proposal = drafter.propose(batch, self.k)
        learned_seconds = None  # only a hybrid drafter's learned part can be switched off, so only it is timed
        if isinstance(drafter, HybridDrafter) and drafter.learned_ran:
            learned_seconds = drafter.learned_seconds
        return Candidates(drafts=proposal.drafts.tolist(),
                          limits=proposal.limits.tolist() if proposal.limits is not None else [self.k] * rows,
                          sources=(drafter.row_sources if isinstance(drafter, HybridDrafter) else None)
                          or [LEARNED_SOURCE] * rows,
                          learned_seconds=learned_seconds)

    def _remember(self, request_ids: list[str], drafts: list[list[int]], lengths: np.ndarray,
                  sampled: list[list[int]], sources: list[str] | None = None) -> None:
        """What was sent (and who drafted it), for the next step's observe; requests that ended, for telemetry."""
        assert self.drafter is not None
        self.book.remember(request_ids, drafts, lengths, self.drafter.version, sources)
        for request_id in self.book.close_finished(self.runner.requests, request_ids, sampled):
            self.slots.release(request_id)
            self.policy.forget(request_id)

    # ---- the control path -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What the control path (`collective_rpc`) shows an operator."""
        return {"server_id": self.settings.server_id, "version": self.drafter.version if self.drafter else None,
                **(self.swapper.report() if self.swapper else Swapper.idle_report()),
                "forced_version": self.source.forced if self.source else None,
                "source_live_version": self.source.inner.live_version() if self.source else None,
                "k": self.k, "drafter": self.settings.drafter_kind, "steps": self.num_steps,
                "mean_propose_ms": 1000 * self.seconds_proposing / max(self.num_steps, 1),
                **self.faults.status(), **self.policy.status(), **self.telemetry.status(),
                "traffic_table_rows": self.drafter.num_table_rows if isinstance(self.drafter, HybridDrafter) else 0,
                "swaps": self.drafter.num_swaps if self.drafter else 0}

    def force_version(self, version: int | None) -> dict[str, Any]:
        """Serve `version` regardless of announcements (None: follow them again); it takes over within a poll."""
        force_version(self.source, version)
        return self.status()
