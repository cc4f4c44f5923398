"""The speculative-decoding engine: continuous batching, propose, verify in one pass, accept.

Contract: `Engine.step()` admits waiting requests into free slots, prefilling their prompts up
to `prefill_chunk` tokens a step (`specd.engine.prefill`: a long prompt is spread over several
steps instead of stalling the running streams for its whole prefill; a prompt admitted while no
stream runs has none to stall and goes in larger chunks, which are cheaper), then runs one decoding
step for every running request: the drafter proposes k tokens per row,
the target verifies all rows' k + 1 positions in one batched pass, and each row accepts with
exact rejection sampling (`specd.engine.verification`). Greedy output is token-identical to
target-only decoding whatever the drafter; sampled output is distributed as the target's.

KV caches follow overwrite-and-mask: the target cache of a row always holds its sequence minus
the last token (which is the next step's first input); entries written for rejected drafts stay
in the cache but sit past the row's length, where the causal mask hides them, and the next step
overwrites them. Running requests occupy slots 0..B-1; when one finishes, the last row moves
into its slot, so every batched pass reads a plain prefix of the caches.

A drafter that reads the target's hidden states names the layers (`capture_layers`); the prefill
and verification passes then return those features too, at no extra target pass, and the engine
hands each row the features of its verified positions (`observe(slot, start, features)`), and,
with `record_features`, keeps them on the request for its trajectory record.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from specd.core.errors import RequestRefused
from specd.drafter.base import DraftBatch, Drafter, FeatureReader, Proposal, one_hot_q
from specd.drafter.hybrid import CONTINUATION_KINDS, HybridDrafter
from specd.engine.lookahead import LookaheadConfig, LookaheadController
from specd.engine.prefill import InProgress, follow, run_chunk
from specd.engine.prefix_cache import PrefixCache
from specd.engine.request import SamplingParams, Sequence
from specd.engine.step_stats import StepStats, emit_verdict, feed_lookahead
from specd.engine.verification import Verdict, verify_greedy, verify_sampled
from specd.model.distributions import target_probs
from specd.model.packed_linear import prepare_layouts
from specd.model.seeded_draws import PositionNoise, seeded_scores
from specd.model.transformer import Transformer

log = logging.getLogger(__name__)
IDLE_PREFILL_CHUNK = 128   # prompt tokens a step where no row is decoding (`Engine._admit`)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8
    num_draft_tokens: int = 4          # k
    max_context: int | None = None    # prompt + output; None means the target's max_position
    eos_token_ids: tuple[int, ...] = ()
    adaptive_lookahead: bool = True    # pick k per step from measured acceptance and costs
    record_features: bool = False      # keep each request's captured features for its record
    # prompt tokens prefilled per step (chunked prefill, `specd.engine.prefill`): a long prompt
    # then delays the running streams by one chunk a step, not by its whole prefill. None: whole
    prefill_chunk: int | None = 48   # chosen by benchmarks/prefill_stall.py on this machine
    # a seeded sampled request's tokens are its seed's Gumbel-max draws, so its answer is the target
    # alone's under any drafter (`specd.model.seeded_draws`); False: the seed fixes only the random
    # stream that speculative sampling draws from, so the answer varies with the drafts
    seeded_draws: bool = True
    # what the lookahead k governs. "learned": the learned drafter's drafts alone: context
    # continuations (a hybrid's, free to make) are served at every k, 0 included, and k follows the
    # learned drafter's own acceptance. "all": k covers every source (no drafts at k = 0, acceptance
    # over every row), the policy before 2026-12-07, kept for benchmarks/lookahead_policy.py
    lookahead_scope: str = "learned"
    # how far a hybrid's continuations reach with an adaptive lookahead: "measured", as far as
    # pays by their measured acceptance and the pass's measured cost (`continuation_reaches`);
    # "fixed": up to the hybrid's context_k at every step (the policy before 2026-12-07)
    continuation_reach: str = "measured"
    # openings many prompts share (a chat template's system prompt), prefilled once (`engine.prefix_cache`)
    shared_prefixes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be 0 or more, got {self.num_draft_tokens}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 (or None), got {self.prefill_chunk}")
        if self.lookahead_scope not in ("learned", "all"):
            raise ValueError(f"lookahead_scope must be 'learned' or 'all', got {self.lookahead_scope!r}")
        if self.continuation_reach not in ("measured", "fixed"):
            raise ValueError(f"continuation_reach must be 'measured' or 'fixed', got {self.continuation_reach!r}")


class Engine:
    def __init__(self, target: Transformer, drafter: Drafter | None = None,
                 config: EngineConfig = EngineConfig()) -> None:
        self.target = target
        self.config = config
        self.device = target.embed.weight.device
        self.max_context = min(config.max_context or target.config.max_position, target.config.max_position)
        k = config.num_draft_tokens if drafter is not None else 0
        self.k = k
        # room past the context for drafts that are verified and then cut at max_tokens (a hybrid's
        # continuations may reach past k: `context_k`)
        reach = max(config.num_draft_tokens, getattr(drafter, "context_k", None) or 0)
        self._reach = reach   # the most drafts a continuation may propose
        max_seq = self.max_context + reach + 1
        self.cache = target.new_cache(config.max_batch, max_seq)
        self.tokens = torch.zeros(config.max_batch, max_seq, dtype=torch.long, device=self.device)
        self.drafter = drafter
        if drafter is not None:
            drafter.bind(config.max_batch, max_seq, self.device)
        # the linear layers' inference layouts for this thread count, made now rather than in the
        # first request's steps (`specd serve` builds its engine at the thread count it will decode with)
        prepare_layouts(target)
        drafter_model = getattr(drafter, "model", None)
        if isinstance(drafter_model, torch.nn.Module):
            prepare_layouts(drafter_model)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index = slot
        self.prefilling: InProgress | None = None  # in slot len(running), until its prompt is in the cache
        self.prefixes = PrefixCache(config.shared_prefixes)
        self.lookahead = LookaheadController(LookaheadConfig(max_k=config.num_draft_tokens,
                                                             adaptive=config.adaptive_lookahead))
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> Sequence:
        """Queue a request, or raise RequestRefused saying why it cannot be served."""
        if not prompt_ids:
            raise RequestRefused("the prompt is empty: give at least one token", param="prompt")
        # the length first: it costs nothing, and a huge prompt is refused without a pass over it
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise RequestRefused(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context window of {self.max_context} tokens", code="context_length_exceeded")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRefused(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt_ids), params)
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[Sequence]:
        """Decode all prompts together to the end; results in prompt order."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return seqs

    def cancel(self, request_id: str) -> None:
        """End a request at the next step boundary (finish reason "cancelled"), running or waiting."""
        prefilling = (self.prefilling.seq,) if self.prefilling is not None else ()
        for seq in (*self.waiting, *prefilling, *self.running):
            if seq.request_id == request_id and not seq.is_finished:
                seq.finish_reason = "cancelled"

    def reset(self) -> None:
        """Forget every request (after a fault); caches are overwritten by the next prefill."""
        self.waiting.clear()
        self.running.clear()
        self.prefilling = None
        if self.drafter is not None:
            self.drafter.bind(self.config.max_batch, self.cache.max_seq, self.device)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit, decode one step for every running row, retire finished rows; returns them."""
        done = self._retire() + self._drop_cancelled_waiting()  # cancelled since the last step
        done += self._admit()
        if not self.running:
            return done
        begin = time.perf_counter()
        batch = len(self.running)
        lengths = torch.tensor([s.num_tokens for s in self.running], device=self.device)
        left = torch.tensor([s.params.max_tokens - s.num_output_tokens for s in self.running],
                            device=self.device)
        k = self.lookahead.choose(self.drafter.version) if self.drafter is not None and self.k > 0 else 0
        rows_info = self._draft_batch(lengths)  # per-row settings, built once for drafting and verifying
        if self._measures_reach:
            assert isinstance(self.drafter, HybridDrafter)
            self.drafter.reach = self.lookahead.continuation_reaches(CONTINUATION_KINDS, self._reach)
        proposal = self._propose(rows_info, k) if k > 0 or self._continues_at_zero else None
        if proposal is not None and proposal.drafts.shape[1] == 0:  # k = 0 and no row had a continuation
            proposal = None
        drafts = proposal.drafts if proposal is not None else torch.zeros(batch, 0, dtype=torch.long,
                                                                          device=self.device)
        # drafts past a row's remaining budget count as not proposed (more drafts than tokens left)
        limit = (left - 1).clamp(min=0, max=drafts.shape[1])
        if proposal is not None and proposal.limits is not None:
            limit = torch.minimum(limit, proposal.limits)
        drafted = time.perf_counter()
        rows = torch.arange(batch, device=self.device)
        inputs = torch.cat([self.tokens[rows, lengths - 1][:, None], drafts], dim=1)  # [B, width+1]
        capture = self.capture_layers
        # logits: [B, width+1, V]; features: [B, width+1, F] when the drafter reads the target's layers
        logits, features = self.target(inputs, lengths - 1, self.cache, return_hidden=bool(capture),
                                       capture_layers=capture)
        assert logits is not None
        verdict = self._verify(logits, proposal, drafts, limit, rows_info)
        if proposal is not None and self.drafter is not None:
            self.drafter.commit(verdict.num_accepted)
        verified = time.perf_counter()
        stats = self._emit(verdict, drafts, limit, lengths, self.drafter_version)
        if features is not None:
            self._observe_emitted(features, lengths)
        if self.drafter is not None and self.k > 0:
            feed_lookahead(self.lookahead, self.config.lookahead_scope, k, drafts.shape[1], stats,
                           getattr(self.drafter, "learned_ran", True), drafted - begin, verified - drafted)
        stats.seconds, stats.k = time.perf_counter() - begin, k
        self.step_stats.append(stats)
        return done + self._retire()

    @property
    def _measures_reach(self) -> bool:
        """Are a hybrid's continuations reaching as far as their measured acceptance pays for?"""
        return (self._continues_at_zero and self.config.continuation_reach == "measured"
                and self.lookahead.config.adaptive)

    @property
    def _continues_at_zero(self) -> bool:
        """Does a step at k = 0 still ask for drafts? A hybrid's continuations do, where k governs
        the learned drafter alone."""
        return isinstance(self.drafter, HybridDrafter) and self.config.lookahead_scope == "learned"

    def _drop_cancelled_waiting(self) -> list[Sequence]:
        """Requests cancelled while waiting leave the line at once, not when a slot frees up for them."""
        cancelled = [seq for seq in self.waiting if seq.is_finished]
        if cancelled:
            self.waiting = deque(seq for seq in self.waiting if not seq.is_finished)
        return cancelled

    def _admit(self) -> list[Sequence]:
        """Prefill waiting requests, in order, up to the step's token budget; a request whose prompt
        is in the cache starts decoding. Returns those that failed or were cancelled meanwhile."""
        done: list[Sequence] = []
        budget = self.config.prefill_chunk
        while budget is None or budget > 0:
            if self.prefilling is None:
                if not self.waiting or len(self.running) >= self.config.max_batch:
                    break
                seq = self.waiting.popleft()
                self.prefilling = InProgress(seq, len(self.running))
                self.tokens[len(self.running), :len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids,
                                                                                   device=self.device)
            part = self.prefilling
            if part.seq.is_finished:  # cancelled part-way: its slot is free again
                self.prefilling = None
                done.append(part.seq)
                continue
            # chunks keep running rows decoding; with none running larger ones cost less (256 tokens on an
            # AVX2 core: 826 ms whole, 827 in chunks of 128, 984 of 48), and not whole prompts, since
            # oneDNN compiles and caches a primitive, with its scratch memory, for every pass shape
            chunk = None if budget is None else (budget if self.running else max(budget, IDLE_PREFILL_CHUNK))
            try:
                used = run_chunk(self.target, self.cache, self.tokens, part, chunk, self.capture_layers, self.prefixes)
                if part.is_complete:
                    self._start(part)
            except Exception as error:  # traced to this request's admission: it fails alone
                log.exception("prefill of %s failed", part.seq.request_id)
                if self.running and self.running[-1] is part.seq:
                    self.running.pop()
                part.seq.finish_reason, part.seq.error = "error", f"{type(error).__name__}: {error}"
                self.prefilling = None
                done.append(part.seq)
                continue
            if part.is_complete:
                self.prefilling = None
            budget = None if budget is None else budget - used
        return done

    def _start(self, part: InProgress) -> None:
        """A prefilled request joins the running rows."""
        seq, slot = part.seq, part.slot
        seq.generator = torch.Generator()
        if seq.params.seed is not None:
            seq.generator.manual_seed(seq.params.seed)
        else:
            seq.generator.seed()
        if seq.params.seed is not None and seq.params.temperature > 0 and self.config.seeded_draws:
            seq.noise = PositionNoise(seq.params.seed, self.target.config.vocab_size)
        if self.drafter is not None:
            self.drafter.start(slot)
        self.running.append(seq)
        features = part.gathered_features(self.capture_layers)
        if features is not None:
            self._observe(slot, 0, features)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose features the drafter reads; () for a drafter that reads none."""
        return self.drafter.capture_layers if isinstance(self.drafter, FeatureReader) else ()

    def _observe(self, slot: int, start: int, features: torch.Tensor) -> None:
        """Features [n, F] of positions start..start+n-1 of a row: to the drafter and the record."""
        assert isinstance(self.drafter, FeatureReader)  # features are captured for feature readers only
        self.drafter.observe(slot, start, features)
        if self.config.record_features:
            self.running[slot].feature_chunks.append(features.to("cpu", torch.float16))

    def _observe_emitted(self, features: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a step that emitted e tokens in a row of length L: features of positions L-1..L+e-2,
        the verification pass's first e inputs (the last token and the e - 1 accepted drafts)."""
        for slot, (seq, length) in enumerate(zip(self.running, lengths.tolist(), strict=True)):
            self._observe(slot, length - 1, features[slot, :seq.num_tokens - length])

    def _draft_batch(self, lengths: torch.Tensor) -> DraftBatch:
        running = self.running
        return DraftBatch(
            tokens=self.tokens, lengths=lengths,
            prompt_lengths=[len(s.prompt_ids) for s in running],
            request_ids=[s.request_id for s in running],
            temperature=torch.tensor([s.params.temperature for s in running], device=self.device),
            top_p=torch.tensor([s.params.top_p for s in running], device=self.device),
            generators=[s.generator for s in running], noises=[s.noise for s in running])

    def _propose(self, rows_info: DraftBatch, k: int) -> Proposal:
        assert self.drafter is not None
        proposal = self.drafter.propose(rows_info, k)
        vocab = self.target.config.vocab_size
        # a drafter's output is untrusted: out-of-vocabulary drafts would index out of range, and
        # more drafts than the cache has room for past the context would write beyond it
        room = self.tokens.shape[1] - self.max_context - 1
        proposal.drafts = proposal.drafts[:, :room].clamp(0, vocab - 1)
        if proposal.q is not None:
            proposal.q = proposal.q[:, :room]
        return proposal

    def _verify(self, logits: torch.Tensor, proposal: Proposal | None, drafts: torch.Tensor,
                limit: torch.Tensor, rows_info: DraftBatch) -> Verdict:
        is_greedy = rows_info.is_greedy
        if bool(is_greedy.all()):
            return verify_greedy(logits, drafts, limit)
        p = target_probs(logits, rows_info.temperature, rows_info.top_p)
        # greedy and seeded rows keep the argmax of their scores (a seeded row's: its noisy scores)
        is_greedy = is_greedy | rows_info.is_seeded
        greedy = verify_greedy(seeded_scores(logits, p, rows_info.noises, rows_info.lengths), drafts, limit)
        if bool(is_greedy.all()):
            return greedy
        k = drafts.shape[1]
        q = proposal.q if proposal is not None and proposal.q is not None else one_hot_q(drafts, p.shape[-1])
        uniforms = torch.stack([torch.rand(k + 1, generator=s.generator) for s in self.running])
        uniforms = uniforms.to(self.device)
        sampled = verify_sampled(p, q.to(p.dtype), drafts, limit, uniforms[:, :k], uniforms[:, k])
        if not bool(is_greedy.any()):
            return sampled
        return Verdict(torch.where(is_greedy, greedy.num_accepted, sampled.num_accepted),
                       torch.where(is_greedy[:, None], greedy.tokens, sampled.tokens))

    def _emit(self, verdict: Verdict, drafts: torch.Tensor, limit: torch.Tensor,
              lengths: torch.Tensor, version: int | None) -> StepStats:
        # who drafted each row: a hybrid drafter names it per row ("context4", "table2", "learned", ...)
        sources = self.drafter.row_sources if isinstance(self.drafter, HybridDrafter) else None
        return emit_verdict(self.running, self.tokens, verdict, drafts, limit, lengths, version, sources,
                            set(self.config.eos_token_ids))

    @property
    def drafter_version(self) -> int | None:
        """The version that drafts the next step; None when no drafter runs."""
        return self.drafter.version if self.drafter is not None and self.k > 0 else None

    def _retire(self) -> list[Sequence]:
        finished = [slot for slot, seq in enumerate(self.running) if seq.is_finished]
        done = [self.running[slot] for slot in finished]
        for slot in reversed(finished):
            last = len(self.running) - 1
            if slot != last:
                moved = self.running[last]
                self.cache.move_slot(last, slot, moved.num_tokens)
                self.tokens[slot, :moved.num_tokens] = self.tokens[last, :moved.num_tokens]
                if self.drafter is not None:
                    self.drafter.move(last, slot)
                self.running[slot] = moved
            self.running.pop()
        if finished and self.prefilling is not None:
            follow(self.prefilling, self.cache, self.tokens, len(self.running))
        return done
