"""How sure vLLM's EAGLE-3 drafter is of each draft: the top probability of every drafting pass.

Contract: `PassConfidence.attach(proposer)` replaces the proposer's greedy sampling (the instance's
`_greedy_sample`, which each drafting pass calls while drafts are greedy) by one that takes the
same argmax over the draft vocabulary's logits (the same logits processor, the same draft-to-target
offset) and also keeps softmax's top probability per row. `start(passes, worth_another)` before
vLLM drafts a step and `take(rows)` after it return them as [rows][passes] floats (an empty list
per row where EAGLE-3 made no draft). Between two passes `worth_another` (given the confidences so
far) may say that no row's next draft is worth its pass: drafting then stops there, and the
proposer's `propose` (wrapped too) returns the drafts made so far, as vLLM's own dynamic
speculation would have with that many scheduled (the loop's later passes only ever follow the
earlier ones, and the next step rebuilds its inputs from the target's). It only attaches where it
draws the very tokens vLLM would: one tensor-parallel rank and the draft vocabulary mapped by an
offset table (or none); elsewhere `attach` returns False, vLLM's sampling is left alone and `take`
returns None. The drafts are verified as one-hot either way, so their confidence can change how
many are sent, never an output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WorthAnother = Callable[[list[list[float]]], bool]


class EnoughDrafts(Exception):
    """Raised from a drafting pass's sampling when no row's next draft is worth another pass."""


class PassConfidence:
    def __init__(self) -> None:
        self._passes: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []
        self._wanted = 0
        self._worth_another: WorthAnother | None = None
        self.attached = False
        self.stopped_early = 0   # steps whose drafting stopped before the passes asked for

    def attach(self, proposer: Any) -> bool:
        model = proposer.model
        processor, head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
        if processor is None or head is None or int(getattr(head, "tp_size", 1)) != 1 \
                or getattr(proposer, "use_heterogeneous_vocab", False):
            return False
        offsets = getattr(model, "draft_id_to_target_id", None)

        def greedy_sample(hidden_states: torch.Tensor) -> torch.Tensor:
            logits = processor(head, hidden_states)
            top, ids = logits.max(dim=-1)
            # softmax's largest value without the whole softmax: 1 / sum(exp(logits - max))
            self._passes.append(torch.exp(logits.float() - top.float().unsqueeze(-1)).sum(dim=-1).reciprocal())
            tokens = ids + offsets[ids] if offsets is not None else ids
            self._tokens.append(tokens)
            if len(self._passes) < self._wanted and self._worth_another is not None \
                    and not self._worth_another(torch.stack(self._passes, dim=1).tolist()):
                raise EnoughDrafts
            return tokens

        propose = proposer.propose

        def propose_until_enough(*args: Any, **kwargs: Any) -> Any:
            try:
                return propose(*args, **kwargs)
            except EnoughDrafts:
                self.stopped_early += 1
                return torch.stack(self._tokens, dim=1)

        proposer._greedy_sample = greedy_sample
        proposer.propose = propose_until_enough
        self.attached = True
        return True

    def start(self, passes: int = 0, worth_another: WorthAnother | None = None) -> None:
        """A step's drafting begins: `passes` asked for, `worth_another` consulted between them."""
        self._passes, self._tokens = [], []
        self._wanted, self._worth_another = passes, worth_another

    def take(self, rows: int) -> list[list[float]] | None:
        if not self.attached:
            return None
        if not self._passes:
            return [[] for _ in range(rows)]
        confidences: list[list[float]] = torch.stack(self._passes, dim=1)[:rows].tolist()
        self._passes, self._tokens = [], []
        return confidences
