"""Record a target's own greedy outputs and hand them back as a `ReplayDrafter`.

Contract: `record_greedy` decodes the prompts with the target alone (no drafter) and returns a
drafter that proposes exactly those outputs: the zero-cost, always-right drafter that measures
how much of an accept length the engine turns into speed.
"""

from __future__ import annotations

from specd.drafter.replay import ReplayDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.transformer import Transformer


def record_greedy(target: Transformer, prompts: list[list[int]], max_tokens: int,
                  eos_token_ids: tuple[int, ...] = (), max_batch: int = 8) -> ReplayDrafter:
    """Decode the prompts target-only (greedy) and return a drafter that replays the outputs."""
    engine = Engine(target, None, EngineConfig(max_batch=max_batch, eos_token_ids=eos_token_ids, prefill_chunk=None))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return ReplayDrafter({tuple(p): seq.output_ids for p, seq in zip(prompts, outputs, strict=True)})
