"""Which rows should context matches serve in specd's hybrid drafter: accept length by the shortest match used.

The shipped drafter serves validation traffic (not the demo's): the first turns of ShareGPT
conversations in `traffic.VALIDATION_RANGE` and HumanEval problems the demo never serves (from
`--humaneval-from` on, in the demo's seeded order), greedy, k fixed (no lookahead controller),
batch `--batch`, in rounds of `--batch` requests whose finished text then feeds the traffic table
(as the demo feeds it). Arms: the learned drafter alone, and hybrids whose context matches must be
at least `c` tokens long and table continuations at least `t` (`--min-match c/t,...`; 2/2 is the
default `HybridDrafter`). Per arm and domain: the accept length (target tokens per verification
pass) and, per source, the passes it served, how often its first draft was accepted and its own
accept length. Greedy outputs must be equal in every arm (verification keeps them so); the run
fails otherwise. Accept lengths are deterministic here,
so one round is the figure (`--repeats` is not used). Writes out/hybrid_policy.json.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from common import markdown_table, parser, write_result

from specd.core.traffic import VALIDATION_RANGE, is_short_chat_turn, iter_conversations_in, load_humaneval
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.traffic_table import TrafficTable
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget


def traffic(loaded: LoadedTarget, requests: int, humaneval_from: int) -> dict[str, list[list[int]]]:
    chat = [loaded.encode_messages([messages[0]]) for _, messages in iter_conversations_in(VALIDATION_RANGE)
            if is_short_chat_turn(messages[0]["content"])][:requests]
    problems = load_humaneval(humaneval_from + requests)[humaneval_from:]
    return {"sharegpt": chat, "humaneval": [loaded.encode(item.prompt or "") for item in problems]}


def serve(loaded: LoadedTarget, model: Any, min_match: tuple[int, int] | None, prompts: list[list[int]], k: int,
          batch: int, max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    """One arm on one domain: `min_match` (context, table) None is the learned drafter alone."""
    learned = build_drafter(DrafterSpec(kind="learned", arch="feature"), model, 1)
    table = TrafficTable(min_n=min_match[1]) if min_match is not None else None
    drafter = learned if min_match is None else HybridDrafter(learned, table, min_n=min_match[0])  # type: ignore[arg-type]
    # k fixed: the lookahead controller would choose k by measured step times, and so differ run to run
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=batch, num_draft_tokens=k, adaptive_lookahead=False,
                                                        eos_token_ids=loaded.eos_token_ids))
    outputs: list[list[int]] = []
    by_source: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # passes, first accepted, accepted
    for first in range(0, len(prompts), batch):
        for seq in engine.generate(prompts[first:first + batch], SamplingParams(max_tokens=max_tokens)):
            outputs.append(seq.output_ids)
            if table is not None:
                table.add(seq.prompt_ids + seq.output_ids)
            for step in seq.steps:
                counts = by_source[step.source]
                counts[0] += 1
                counts[1] += step.num_accepted > 0
                counts[2] += step.num_accepted
    passes = sum(c[0] for c in by_source.values())
    result = {"accept_length": sum(len(o) for o in outputs) / max(1, passes), "passes": passes,
              "sources": {source: {"passes": c[0], "first_accepted": c[1] / c[0], "accept_length": 1 + c[2] / c[0]}
                          for source, c in sorted(by_source.items())}}
    return result, outputs


def main() -> None:
    p = parser(__doc__, "out/hybrid_policy.json", repeats=1)
    p.add_argument("--requests", type=int, default=20, help="requests per domain")
    p.add_argument("--humaneval-from", type=int, default=40,
                   help="first HumanEval problem used (the demo serves and holds out the first 28)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-match", default="2/2,3/3,4/4,2/3,2/4",
                   help="hybrid arms: shortest context match / table continuation each uses")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = LoadedTarget.load()
    model = initial_model(loaded.model, DrafterSpec(kind="hybrid", arch="feature", pretrained=True),
                          fingerprint=loaded.fingerprint)
    arms: dict[str, tuple[int, int] | None] = {"learned": None}
    for pair in args.min_match.split(","):
        context, table = (int(n) for n in pair.split("/"))
        arms[f"hybrid context >= {context}, table >= {table}"] = (context, table)
    result: dict[str, Any] = {"k": args.k, "batch": args.batch, "max_tokens": args.max_tokens, "arms": {}}
    for domain, prompts in traffic(loaded, args.requests, args.humaneval_from).items():
        reference = None
        for name, min_match in arms.items():
            figures, outputs = serve(loaded, model, min_match, prompts, args.k, args.batch, args.max_tokens)
            if reference is None:
                reference = outputs
            elif outputs != reference:
                raise SystemExit(f"{name} on {domain}: greedy outputs differ from the learned drafter's")
            result["arms"].setdefault(name, {})[domain] = figures
            print(f"{domain} {name}: accept length {figures['accept_length']:.3f}", flush=True)
    write_result(args.out, args, result)
    rows = [[name, *(f"{arm[d]['accept_length']:.3f}" for d in ("sharegpt", "humaneval"))]
            for name, arm in result["arms"].items()]
    print(markdown_table(["arm", "ShareGPT (validation) accept length", "HumanEval accept length"], rows))


if __name__ == "__main__":
    main()
