"""specd's vLLM general plugin: attaches the `eagle3` route's companion inside vLLM's workers.

Contract: registered as the `vllm.general_plugins` entry point `specd` (pyproject.toml), so vLLM
calls `register()` in each of its processes before building workers. It does nothing unless
`SPECD_ROUTE=eagle3` (which `specd vllm` sets); then it wraps two vLLM methods, once:
`EagleProposer.load_model` (after vLLM loads the drafter, attach an `Eagle3Companion` to it) and
the model runner's `propose_draft_token_ids` (a proposer with a companion drafts through it).
vLLM itself is not modified; a process that never builds an EAGLE proposer is unaffected.
"""

from __future__ import annotations

import functools
import os
from typing import Any

ROUTE_VARIABLE = "SPECD_ROUTE"


def register() -> None:
    if os.environ.get(ROUTE_VARIABLE) != "eagle3":
        return
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(EagleProposer.load_model, "specd_wrapped", False):
        return
    EagleProposer.load_model = _after_load(EagleProposer.load_model)  # type: ignore[method-assign]
    GPUModelRunner.propose_draft_token_ids = _through_companion(  # type: ignore[method-assign]
        GPUModelRunner.propose_draft_token_ids)


def _after_load(load_model: Any) -> Any:
    @functools.wraps(load_model)
    def load_and_attach(proposer: Any, target_model: Any) -> None:
        from specd.serving.vllm.eagle3.companion import Eagle3Companion

        load_model(proposer, target_model)
        proposer.specd_companion = Eagle3Companion(proposer).attach()

    load_and_attach.specd_wrapped = True  # type: ignore[attr-defined]
    return load_and_attach


def _through_companion(propose: Any) -> Any:
    @functools.wraps(propose)
    def propose_with_companion(runner: Any, scheduler_output: Any, sampled: Any, *args: Any, **kwargs: Any) -> Any:
        companion = getattr(runner.drafter, "specd_companion", None)
        if companion is None:
            return propose(runner, scheduler_output, sampled, *args, **kwargs)
        return companion.propose(runner, propose, scheduler_output, sampled, *args, **kwargs)

    return propose_with_companion
