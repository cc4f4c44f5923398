"""Shared stand-ins (tiny random Llama-family models that honour the real interfaces), the check
that fails a marked test whose dependency is missing (`dependencies`), instead of skipping it, and
the plain vLLM server every vLLM test module checks its greedy outputs against, started once a run
(`plain_vllm`, `plain_vllm_tokens`; tests/vllm_reference.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from dependencies import pytest_collection_modifyitems
from vllm_reference import MAX_TOKENS, PROMPTS, VLLM_ARGS

from specd.core.records import AcceptanceCounts, source_kind
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import EngineConfig
from specd.engine.request import Sequence
from specd.model.bundled import bundled_target_dir
from specd.model.transformer import Transformer
from specd.testing import TINY, learnable_target, tiny_target
from specd.testing.processes import VllmServer, ask_all, free_port, token_ids

__all__ = ["TINY", "learnable_target", "pytest_collection_modifyitems", "tiny_target"]
pytest_plugins = ["pytester"]  # tests/test_dependencies.py runs pytest on planted test files

TINY_DRAFTER = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)


def fixed_k(**fields) -> EngineConfig:
    """An engine config that drafts exactly num_draft_tokens every step (no lookahead control)."""
    return EngineConfig(adaptive_lookahead=False, **fields)


def always_right_counts(num_output: int, max_tokens: int, k: int) -> tuple[int, int, int]:
    """(target passes, drafts proposed, drafts accepted) of a request whose every draft is right, at fixed k."""
    # each pass accepts its drafts and adds a token; drafts past max_tokens are not proposed. The one loss
    # is an EOS (num_output < max_tokens) that is itself a draft: the drafts after it count, unaccepted
    passes = proposed = accepted = emitted = 0
    while emitted < num_output:
        limit = min(k, max_tokens - emitted - 1)
        passes, proposed = passes + 1, proposed + limit
        if num_output - emitted <= limit:  # EOS among the drafts: accepted up to it, then the request stops
            accepted, emitted = accepted + num_output - emitted, num_output
        else:
            accepted, emitted = accepted + limit, emitted + limit + 1
    return passes, proposed, accepted


def counts_by_source(seqs: list[Sequence]) -> dict[str, AcceptanceCounts]:
    """What each drafting source's steps proposed, had accepted and emitted (a step emits up to the
    next step's position), computed from the requests' own steps."""
    totals: dict[str, AcceptanceCounts] = {}
    for seq in seqs:
        ends = [step.position for step in seq.steps[1:]] + [seq.num_tokens]
        for step, end in zip(seq.steps, ends, strict=True):
            emitted = end - step.position
            totals.setdefault(source_kind(step.source, len(step.drafts)), AcceptanceCounts()).add(
                AcceptanceCounts(len(step.drafts), min(step.num_accepted, emitted), 1, emitted))
    return totals


def tiny_drafter(target: Transformer, seed: int = 1) -> TokenDrafter:
    return TokenDrafter(new_drafter_model(target, TINY_DRAFTER, copy_from_target=True, seed=seed))


@pytest.fixture
def target() -> Transformer:
    return tiny_target()


@pytest.fixture(autouse=True)
def one_torch_thread(request: pytest.FixtureRequest):
    """Tiny models on one intra-op thread: threads gain them nothing, and on a busy machine threads
    that spin waiting for each other slow them 10-100x. Slow tests (real models) keep the default."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def plain_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """Plain vLLM serving the bundled SmolLM2: the reference of every vLLM test module (tests/vllm_reference.py)."""
    server = VllmServer(str(bundled_target_dir()), free_port(), tmp_path_factory.mktemp("plain-vllm") / "vllm.log",
                        extra=VLLM_ARGS).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_vllm_tokens(plain_vllm: VllmServer) -> dict[str, list[int]]:
    """Plain vLLM's greedy token ids for each of `PROMPTS`."""
    answers = ask_all(plain_vllm, PROMPTS, MAX_TOKENS)
    return {prompt: token_ids(answer) for prompt, answer in zip(PROMPTS, answers, strict=True)}
