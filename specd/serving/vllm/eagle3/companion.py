"""specd's online loop around vLLM's own EAGLE-3 proposer (the `eagle3` route).

Contract: vLLM serves the feature drafter with its native `eagle3` method from a folder specd
exported (`specd.drafter.vllm_format`); `specd.serving.vllm.eagle3.plugin` attaches an `Eagle3Companion` to
vLLM's `EagleProposer` once it has loaded, and routes the model runner's proposal step through
`Eagle3Companion.propose`. Around vLLM's own drafting, at each step the companion
1. observes the previous step's outcome (per row: drafts the scheduler actually verified, from
   `scheduled_spec_decode_tokens`, and accepted = sampled tokens - 1, the counts vLLM's own
   per-request metrics report) and closes finished requests into trajectory records for the
   learner (token ids only: the learner recomputes the features with its own target copy);
2. installs a new version if the swapper thread has one ready: the tensors were read, checked
   (sha256, fingerprint, names, shapes, finite values) and converted off the decoding thread;
   installing copies them into the running drafter's parameters between two steps, never
   touching the target's shared embedding. On CPU, vLLM packs linear weights into oneDNN handles
   and leaves empty parameters behind: in eager mode the swapper's thread packs each new weight
   as vLLM does at load and installing hands the layers their new handles; in compiled mode
   (whose graphs keep the handles they were traced with) those layers are served from real
   parameters from load on, holding vLLM's packed-weight layout where it has one (bfloat16), so
   every swap is an in-place copy of weights the swapper's thread already packed
   (`specd.serving.vllm.eagle3.weights`).
3. with `SPECD_DRAFTER=hybrid` (the default), drafts per row and step from the row's context or
   the traffic table where the draft budget expects that to earn more than EAGLE-3's drafts, and
   from EAGLE-3 elsewhere (`specd.serving.vllm.eagle3.hybrid_rows`); every row's drafts are then trimmed to
   those worth verifying (`specd.serving.vllm.shared.policy.DraftPolicy`, as on the custom route), and records
   name the source of each step's drafts. With `SPECD_CONFIDENCE=1`, EAGLE-3's rows are trimmed by
   its own confidence in each draft (`specd.serving.vllm.eagle3.confidence`: the top probability of
   each drafting pass, calibrated against acceptance), which also weighs them against the row's
   context. EAGLE-3 drafts only what is worth drafting and verifying
   (`SPECD_EAGLE_K=adaptive`, the default): with its confidence read, it drafts until no row it
   serves has a next draft worth its pass (each pass after the first priced at its measured time);
   without, as many drafts as the draft budget keeps for a learned row at this batch size; and
   none where context serves every row of the step; with `SPECD_EAGLE_MAX` below vLLM's
   k (`specd vllm --context-k`), EAGLE-3 never drafts past it while context rows may. vLLM is
   asked for that many (its dynamic speculation's per-step k; 0 runs only the pass that keeps
   its KV cache following every row), and the scheduler's own k is left as it was. vLLM verifies
   these drafts as one-hot (EAGLE-3 hands it no probabilities here), so outputs are those of vLLM
   alone; were a vLLM to hand over draft probabilities, the hybrid stands aside and vLLM's drafts
   go out unchanged.
It needs `disable_padded_drafter_batch` (the proposal then runs after vLLM's bookkeeping, on the
CPU-side sampled tokens, as `custom_class` does); `launch.speculative_config` sets it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specd.core.errors import CheckpointError
from specd.core.records import LEARNED_SOURCE
from specd.drafter.base import BUILT_IN_VERSION
from specd.drafter.checkpoint import DrafterModel, load_drafter, read_metadata
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.swap import HotSwapped
from specd.drafter.traffic_table import TrafficTable
from specd.drafter.vllm_format import SPECD_CHECKPOINT, vllm_parameters
from specd.hotswap.swapper import Swapper
from specd.model.fingerprint import TargetFingerprint
from specd.model.loading import read_target_head
from specd.serving.vllm.eagle3.confidence import PassConfidence, WorthAnother
from specd.serving.vllm.eagle3.hybrid_rows import HybridRows
from specd.serving.vllm.eagle3.weights import (
    InPlaceKernel,
    Prepared,
    drafter_gemm_dtype,
    install,
    prepare,
    vllm_cpu_in_place_kernel,
    vllm_cpu_repack,
)
from specd.serving.vllm.shared.budget import DraftBudget
from specd.serving.vllm.shared.launch import PluginSettings
from specd.serving.vllm.shared.policy import DraftPolicy
from specd.serving.vllm.shared.worker_loop import PinnedSource, RequestBook, StepFaults, follow_versions, force_version

log = logging.getLogger(__name__)


class VllmDrafterSlot(HotSwapped[tuple[FeatureDrafterModel, dict[str, torch.Tensor] | Prepared]]):
    """What the swapper hands versions to: checks them and converts them to vLLM's tensors on its
    thread (with `preparer`, also cast and packed as vLLM's drafter holds them); `installer` writes
    them into vLLM's drafter on the decoding thread, between steps."""

    serves = FeatureDrafterModel

    def __init__(self, model: FeatureDrafterModel, version: int, device: torch.device,
                 installer: Callable[[dict[str, torch.Tensor] | Prepared], None] | None = None,
                 preparer: Callable[[dict[str, torch.Tensor]], Prepared] | None = None) -> None:
        super().__init__(version)
        self.model, self.device, self.installer, self.preparer = model, device, installer, preparer

    def check_compatible(self, model: DrafterModel) -> None:
        if not isinstance(model, FeatureDrafterModel) or model.config != self.model.config:
            raise CheckpointError("vLLM's drafter takes versions of its own shape only (the same layers, "
                                  "captured layers and draft vocabulary); this version differs")

    def prepare(self, model: DrafterModel) -> tuple[FeatureDrafterModel, dict[str, torch.Tensor] | Prepared]:
        assert isinstance(model, FeatureDrafterModel)
        tensors = {name: tensor.to(self.device) for name, tensor in vllm_parameters(model).items()}
        return model, self.preparer(tensors) if self.preparer is not None else tensors

    def install(self, payload: tuple[FeatureDrafterModel, dict[str, torch.Tensor] | Prepared]) -> None:
        model, tensors = payload
        if self.installer is not None:
            self.installer(tensors)
        self.model = model


class Eagle3Companion:
    def __init__(self, proposer: Any) -> None:
        vllm_config = proposer.vllm_config
        self.settings = PluginSettings.from_env()
        self.proposer = proposer
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.target_dir = Path(str(vllm_config.model_config.model))
        self.drafter_dir = Path(str(vllm_config.speculative_config.model))
        self.book = RequestBook(self.settings, self.max_model_len)
        self.num_steps = 0
        self.faults = StepFaults()
        self._vllm_answer: Any = None      # vLLM's drafts of the step in progress, once it has made them
        self.seconds_outside_vllm = 0.0    # observing, closing and installing: specd's cost per step
        self.seconds_drafting = 0.0        # vLLM's own EAGLE-3 drafting, for comparison
        self.install_seconds: deque[float] = deque(maxlen=32)
        self.slot: VllmDrafterSlot | None = None
        self.repack: Callable[[nn.Module], None] | None = None
        self.in_place: InPlaceKernel | None = None
        self.gemm_dtype: torch.dtype | None = None   # eager drafter layers computing in another dtype than vLLM's
        self.swapper: Swapper | None = None
        self.source: PinnedSource | None = None
        self.policy = DraftPolicy(DraftBudget(self.k), self.max_model_len)
        table = TrafficTable() if self.settings.traffic_table else None
        # made even when off, so that an operator can switch it on (and off) while serving
        self.hybrid = HybridRows(self.k, table)
        self.hybrid_on = self.settings.drafter_kind == "hybrid"
        self.confidence = PassConfidence()
        self.hybrid_stood_aside = 0        # steps where vLLM's drafts carried probabilities
        self.eagle_stood_down = 0          # steps where context served every row and EAGLE-3 did not draft
        self.eagle_passes_saved = 0        # EAGLE-3 drafting passes not run (k minus the step's k, summed)

    @property
    def recent(self) -> deque[dict[str, Any]]:
        return self.book.telemetry.recent

    def attach(self) -> Eagle3Companion:
        """After vLLM loaded the exported drafter: install specd's copy of it (`install`: repacked in
        eager mode, real parameters in compiled mode), then follow versions and send records."""
        config, embed, _ = read_target_head(self.target_dir)
        fingerprint = TargetFingerprint.of(config, self.target_dir)
        device = next(self.proposer.model.parameters()).device
        path = self.drafter_dir / SPECD_CHECKPOINT
        model = load_drafter(path, fingerprint, target_embedding=embed)
        if not isinstance(model, FeatureDrafterModel):
            raise CheckpointError(f"{path}: not a feature drafter")
        version = int(read_metadata(path).get("specd_version", BUILT_IN_VERSION))  # written by export_eagle3
        compiled = int(getattr(self.proposer.vllm_config.compilation_config, "mode", 0) or 0) != 0
        if device.type == "cpu" and not compiled:  # eager: every layer repacked by vLLM's dispatch, in gemm_dtype
            served = next(p.dtype for p in self.proposer.model.parameters() if p.is_floating_point())
            self.gemm_dtype = drafter_gemm_dtype(self.settings.drafter_gemm, served)
            self.repack = vllm_cpu_repack(self.gemm_dtype)
        self.in_place = vllm_cpu_in_place_kernel() if device.type == "cpu" and compiled else None
        install(self.proposer.model, vllm_parameters(model), self.repack, self.in_place)
        if self.settings.confidence and not self.confidence.attach(self.proposer):
            log.info("EAGLE-3's drafts are trimmed by position only: this proposer's sampling is not one specd reads")
        self.slot = VllmDrafterSlot(model, version, device, self._install_tensors,
                                    lambda tensors: prepare(self.proposer.model, tensors, self.in_place, self.repack))
        self.source, publisher = follow_versions(self.settings)
        self.swapper = Swapper(self.source, self.slot, fingerprint, target_embedding=embed)
        self.swapper.check_once()
        self.swapper.start()
        self.book.telemetry.start(publisher, self.hybrid.table)
        log.info("specd follows versions into vLLM's EAGLE-3 drafter (started from version %s)", version)
        return self

    # ---- the decoding thread ----------------------------------------------------------------
    def propose(self, runner: Any, vllm_propose: Any, scheduler_output: Any, sampled: Any, *args: Any,
                **kwargs: Any) -> Any:
        """This step's drafts; a fault in specd's part leaves vLLM's own EAGLE-3 drafts (see `StepFaults`)."""
        self._vllm_answer = None
        try:
            return self._propose(runner, vllm_propose, scheduler_output, sampled, *args, **kwargs)
        except Exception as error:
            self.faults.note(error, self.book)
            if self._vllm_answer is not None:
                return self._vllm_answer
            return vllm_propose(runner, scheduler_output, sampled, *args, **kwargs)  # vLLM's own step

    def _propose(self, runner: Any, vllm_propose: Any, scheduler_output: Any, sampled: Any, *args: Any,
                 **kwargs: Any) -> Any:
        begin = time.perf_counter()
        if not isinstance(sampled, list):
            raise RuntimeError("specd's eagle3 route needs the speculative config's disable_padded_drafter_batch")
        batch = runner.input_batch
        rows = len(sampled)
        request_ids = [str(r) for r in batch.req_ids[:rows]]
        lengths = np.asarray(batch.num_tokens_no_spec[:rows])
        self._trim_to_scheduled(scheduler_output.scheduled_spec_decode_tokens)
        assert self.slot is not None
        self.book.observe(request_ids, sampled, lengths, np.asarray(batch.num_prompt_tokens[:rows]),
                          batch.token_ids_cpu, self.slot.version)
        self.policy.observe(request_ids, sampled, self.book.tracker, begin)
        self.hybrid.observe(request_ids, self.book.tracker, self.policy.budget)
        self._install_pending()
        offers = self.hybrid.offers(batch.token_ids_cpu, lengths) if self.hybrid_on and rows else []
        eagle_k = self._eagle_k(offers, request_ids, scheduler_output.num_spec_tokens_to_schedule)
        vllm_began = time.perf_counter()
        self.confidence.start(eagle_k, self._worth_another(offers, request_ids, eagle_k))
        drafts = self._vllm_drafts(vllm_propose, runner, scheduler_output, sampled, eagle_k, *args, **kwargs)
        vllm_ended = time.perf_counter()
        eagle = drafts.tolist() if isinstance(drafts, torch.Tensor) else [list(d) for d in drafts]
        eagle = [list(d) for d in eagle[:rows]]
        confidences = self.confidence.take(rows)
        passes = len(confidences[0]) if confidences else eagle_k  # fewer where drafting stopped early
        # the price of EAGLE-3's own passes, for the next steps' eagle_k: no draft and one draft both
        # cost the feeding pass alone, so the steps where it stood down anchor the fit
        self.policy.budget.observe_drafting(max(passes - 1, 0), vllm_ended - vllm_began)
        sent, sources = eagle, None
        if self.hybrid_on and rows:
            if getattr(runner, "_draft_probs", None) is None:
                candidates = self.hybrid.candidates(request_ids, eagle, offers, lengths, self.policy.budget,
                                                    confidences)
                sent = self.policy.choose(request_ids, candidates, lengths, sampled)
                sources = candidates.sources
                drafts = sent
            else:  # drafts with probabilities are verified against them: not ours to replace
                self.hybrid_stood_aside += 1
        self.book.remember(request_ids, sent, lengths, self.slot.version, sources)
        for request_id in self.book.close_finished(runner.requests, request_ids, sampled):
            self.policy.forget(request_id)
            self.hybrid.forget(request_id)
        self.num_steps += 1
        self.seconds_outside_vllm += (vllm_began - begin) + (time.perf_counter() - vllm_ended)
        self.seconds_drafting += vllm_ended - vllm_began
        return drafts

    def _eagle_k(self, offers: list[tuple[list[int], str]], request_ids: list[str], scheduled: int) -> int:
        """How many drafts EAGLE-3 makes this step: the scheduler's k (never more than `SPECD_EAGLE_MAX`,
        which leaves vLLM's larger k to context and table rows), or with `eagle_k` adaptive and
        hybrid drafting on, none where context serves every row, else as many as the budget would
        draft and send for a learned row, its drafting passes priced in (it sends all k while
        unmeasured, and at its exploring steps)."""
        # drafts with probabilities (seen at an earlier step) are vLLM's to verify: EAGLE-3 drafts them all
        if self.hybrid_stood_aside:
            return scheduled
        reach = min(scheduled, self.settings.eagle_max or scheduled)  # context rows may draft more than EAGLE-3
        if self.settings.eagle_k != "adaptive" or not offers:
            return reach
        if self.hybrid.context_serves_every_row(offers, self.policy.budget, reach, request_ids):
            return 0
        self.policy.budget.rows = len(request_ids)  # the price of a verified token depends on the batch size
        if self.confidence.attached:  # drafting stops between passes once no row's next draft pays
            return reach
        return self.policy.budget.keep(LEARNED_SOURCE, reach, drafting=True)

    def _worth_another(self, offers: list[tuple[list[int], str]], request_ids: list[str],
                       eagle_k: int) -> WorthAnother | None:
        """Between EAGLE-3's passes: whether a row it is expected to serve (no context match that
        pays more) still has a next draft worth its pass (`DraftBudget.worth_another_pass`). None
        (every pass runs) without its confidence read, without hybrid drafting, with fixed k, and on
        the budget's exploring steps."""
        budget = self.policy.budget
        if not self.confidence.attached or not offers or self.settings.eagle_k != "adaptive" or eagle_k < 2 \
                or budget.exploring:
            return None
        serves = [not pays for pays in self.hybrid.context_pays(offers, budget, eagle_k, request_ids)]
        return lambda confidences: budget.worth_another_pass(
            [row for row, served in zip(confidences, serves, strict=False) if served], self.settings.eagle_min_chance)

    def _vllm_drafts(self, vllm_propose: Any, runner: Any, scheduler_output: Any, sampled: Any, eagle_k: int,
                     *args: Any, **kwargs: Any) -> Any:
        """vLLM's EAGLE-3 drafts, `eagle_k` of them per row: below the scheduler's k, for this step only
        (vLLM's own dynamic speculation path; at 0 its proposer runs just the pass that feeds its KV cache)."""
        scheduled = scheduler_output.num_spec_tokens_to_schedule
        if eagle_k >= scheduled:
            self._vllm_answer = vllm_propose(runner, scheduler_output, sampled, *args, **kwargs)
            return self._vllm_answer
        scheduler_output.num_spec_tokens_to_schedule = eagle_k
        try:
            drafts = self._vllm_answer = vllm_propose(runner, scheduler_output, sampled, *args, **kwargs)
        finally:  # the scheduler's own object: leave it as it was
            scheduler_output.num_spec_tokens_to_schedule = scheduled
        self.eagle_stood_down += eagle_k == 0
        self.eagle_passes_saved += scheduled - eagle_k
        return drafts

    def _trim_to_scheduled(self, scheduled: dict[str, list[int]]) -> None:
        """The drafts each request actually had verified: the scheduler trims them near a request's end."""
        for request_id in self.book.tracker.previous_rows:
            trajectory = self.book.tracker.live.get(request_id)
            if trajectory is not None and trajectory.drafts:
                trajectory.drafts = trajectory.drafts[:len(scheduled.get(request_id, ()))]

    def _install_pending(self) -> None:
        assert self.slot is not None
        if self.slot.apply_pending():
            log.info("vLLM's drafter now serves version %s", self.slot.version)

    def _install_tensors(self, tensors: dict[str, torch.Tensor] | Prepared) -> None:
        begin = time.perf_counter()
        install(self.proposer.model, tensors, self.repack, self.in_place)
        self.install_seconds.append(time.perf_counter() - begin)

    # ---- the control path -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        slot, swapper, source = self.slot, self.swapper, self.source
        return {"route": "eagle3", "server_id": self.settings.server_id, "k": self.k,
                "version": slot.version if slot else None,
                **(swapper.report() if swapper else Swapper.idle_report()),
                "forced_version": source.forced if source else None,
                "source_live_version": source.inner.live_version() if source else None,
                "steps": self.num_steps, "mean_specd_ms": 1000 * self.seconds_outside_vllm / max(self.num_steps, 1),
                "mean_vllm_drafting_ms": 1000 * self.seconds_drafting / max(self.num_steps, 1),
                "install_ms": [round(1000 * s, 2) for s in self.install_seconds],
                "drafter_gemm": str(self.gemm_dtype).removeprefix("torch.") if self.gemm_dtype else "native",
                "swaps": slot.num_swaps if slot else 0,
                "hybrid": self.hybrid_on, "hybrid_stood_aside": self.hybrid_stood_aside,
                "confidence_trimming": self.confidence.attached,
                "eagle_stopped_early": self.confidence.stopped_early,
                "eagle_k": self.settings.eagle_k, "eagle_stood_down": self.eagle_stood_down,
                "eagle_passes_saved": self.eagle_passes_saved,
                "rows_by_source": dict(self.hybrid.rows_by_source), "mixed_steps": self.hybrid.mixed_steps,
                **self.faults.status(), **self.policy.status(), **self.book.telemetry.status()}

    def set_hybrid(self, on: bool) -> dict[str, Any]:
        """Hybrid drafting on or off from the next step (the decoding thread reads one flag)."""
        self.hybrid_on = on
        return self.status()

    def force_version(self, version: int | None) -> dict[str, Any]:
        """Serve `version` regardless of announcements (None: follow them again); it takes over within a poll."""
        force_version(self.source, version)
        return self.status()
