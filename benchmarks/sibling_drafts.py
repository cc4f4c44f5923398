"""Would a draft tree pay on this CPU? Chains with sibling leaves, their accept length and their pass cost.

EAGLE-2 and EAGLE-3 verify a tree of drafts, not one chain. The cheapest tree keeps the chain and
adds, at each depth, the drafter's next-best tokens as leaves: they need no drafting pass of their
own (they come from the logits the chain already computed), only wider verification. This
benchmark measures both halves at batch 1, the main job's default:
- accept length, exact: the shipped drafter replayed greedily (teacher-forced, as the gate
  replays; a chain that is right so far drafts exactly what the replay computes) on validation
  traffic the demo never serves (`demo_learner_sweep.validation_items`: HumanEval problems and
  ShareGPT chats), learned drafter alone, k = 4, for: the chain; the chain with one leaf at the
  first depth; with one leaf at every depth; with two leaves at every depth. A pass accepts the
  chain's drafts while they are right, then one leaf if the first wrong depth has a right one;
- the target's pass over one row after `target_pass_cost.CACHED` cached positions, one thread (the demo's
  serving core), per number of positions (1 + drafts), interleaved rounds, medians; and the
  drafter's proposal at k = 4 (the same for every policy), timed inside the engine.
The projected speed of each policy against the chain is accept length over (pass at its width +
drafting). Writes JSON (default out/sibling_drafts.json) and prints a markdown table.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from common import markdown_table, parser, write_result
from demo_learner_sweep import make_records, validation_items
from learning_ceiling import Trajectory, drafter_of, new_learner, trajectories
from target_pass_cost import CACHED, time_pass

from specd.demo.deployment import DEMO_LEARNER, encode
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.feature_model import FeatureDrafterModel
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.learner.simulation import replay_start
from specd.model.packed_linear import prepare_layouts
from specd.model.target import LoadedTarget

K = 4
TOP = 3
# policy -> leaves per depth (depth 0 first); the chain is K drafts deep in every policy
POLICIES = {"chain": [0] * K, "leaf at depth 0": [1, 0, 0, 0], "leaf at every depth": [1] * K,
            "two leaves at every depth": [2] * K}


@torch.no_grad()
def ranks(model: FeatureDrafterModel, trajectory: Trajectory) -> torch.Tensor:
    """ranks[j, e]: where the true token ids[e + 2] stands among chain step j's drafts at entry e
    (0: the chain's own draft; TOP or more: not among the first TOP)."""
    ids, features, prompt_length = trajectory
    start = replay_start(prompt_length)
    out = torch.full((K, len(ids) + 1), TOP, dtype=torch.long)
    for j, state in enumerate(model.unrolled(features[None, :-1], ids[None, 1:], K, start=start)):
        top = model.draft_ids[model.logits(state[0]).topk(TOP, -1).indices]   # [n, TOP]
        entries = torch.arange(start, start + len(top))
        labelled = entries + 2 < len(ids)
        truth = torch.full((len(top),), -1, dtype=torch.long)
        truth[labelled] = ids[entries[labelled] + 2]
        hit = top == truth[:, None]
        out[j, entries] = torch.where(hit.any(-1), hit.float().argmax(-1).long(), TOP)
    return out


def accept_length(tables: list[tuple[int, int, torch.Tensor]], leaves: list[int]) -> float:
    """Tokens per pass over every trajectory: (prompt length, full length, ranks) each."""
    passes = emitted = 0
    for prompt_length, length, rank in tables:
        row = prompt_length
        while row < length:
            accepted = 0
            for depth in range(K):
                if row + depth >= length - 1:
                    break
                r = int(rank[depth, row - 2 + depth])
                if r == 0:
                    accepted += 1
                    continue
                accepted += r <= leaves[depth]   # a right leaf is accepted, and the pass ends there
                break
            passes, emitted, row = passes + 1, emitted + accepted + 1, row + accepted + 1
    return emitted / passes


@torch.inference_mode()
def pass_seconds(loaded: LoadedTarget, widths: list[int], rounds: int, capture: tuple[int, ...]) -> dict[int, float]:
    """The target's verification pass over one row (features for the drafter captured), by width:
    the median over interleaved rounds of `target_pass_cost.time_pass` (one pass each)."""
    model = loaded.model
    prepare_layouts(model)  # as the engine serves it
    cache = model.new_cache(1, CACHED + max(widths) + 1)
    model(torch.randint(0, 1000, (1, CACHED)), torch.tensor([0]), cache, logits_for="none")
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(rounds):
        for width in widths:
            samples[width].append(time_pass(model, cache, 1, width, passes=1, capture=capture) / 1000)
    return {w: statistics.median(v) for w, v in samples.items()}


def drafting_seconds(loaded: LoadedTarget, prompts: list[list[int]], max_tokens: int) -> float:
    """Median time of the shipped drafter's proposal at k = K, batch 1, inside the engine."""
    model = initial_model(loaded.model, DrafterSpec(), seed=0, fingerprint=loaded.fingerprint)
    drafter = build_drafter(DrafterSpec(), model, 1)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=1, num_draft_tokens=K, adaptive_lookahead=False,
                                                        eos_token_ids=loaded.eos_token_ids))
    samples: list[float] = []
    propose = drafter.propose

    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        result = propose(*args, **kwargs)
        samples.append(time.perf_counter() - begin)
        return result

    drafter.propose = timed  # type: ignore[method-assign]
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return statistics.median(samples)


def main() -> None:
    p = parser(__doc__, "out/sibling_drafts.json", 31)
    p.add_argument("--problems", type=int, default=20, help="validation items per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    loaded = LoadedTarget.load()
    torch.set_num_threads(2)
    learner = new_learner(loaded, DEMO_LEARNER)
    model = drafter_of(learner)
    accept: dict[str, dict[str, float]] = {}
    prompts = []
    for domain in ("humaneval", "sharegpt"):
        items = validation_items(args.problems, domain)
        prompts += [encode(loaded, item) for item in items[:4]]
        records = make_records(loaded, items, args.max_tokens)
        tables = [(len(r.prompt_ids), r.num_tokens, ranks(model, t))
                  for r, t in zip(records, trajectories(learner, records), strict=True)]
        accept[domain] = {name: round(accept_length(tables, leaves), 4) for name, leaves in POLICIES.items()}
    torch.set_num_threads(1)  # the demo's serving core
    widths = sorted({1 + K + sum(leaves) for leaves in POLICIES.values()} | {1})
    costs = pass_seconds(loaded, widths, args.repeats, model.config.capture_layers)
    drafting = drafting_seconds(loaded, prompts, args.max_tokens)
    rows, projected = [], {}
    chain_step = costs[1 + K] + drafting
    for name, leaves in POLICIES.items():
        width = 1 + K + sum(leaves)
        step = costs[width] + drafting
        projected[name] = {d: round(accept[d][name] / accept[d]["chain"] * chain_step / step, 4) for d in accept}
        rows.append([name, width, f"{costs[width] * 1000:.1f}",
                     *(f"{accept[d][name]:.3f} ({projected[name][d]:.2f}x)" for d in accept)])
    print(markdown_table(["policy", "positions a pass", "pass ms", "HumanEval accept (speed vs chain)",
                          "ShareGPT accept (speed vs chain)"], rows))
    print(f"drafting at k = {K}: {drafting * 1000:.1f} ms; a one-position pass {costs[1] * 1000:.1f} ms")
    write_result(args.out, args, {"k": K, "accept_length": accept, "pass_seconds": costs,
                                  "drafting_seconds": drafting, "projected_speed_vs_chain": projected,
                                  "policies": POLICIES})


if __name__ == "__main__":
    main()
