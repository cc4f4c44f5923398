"""How the learned drafter should draft for sampled requests: its argmax (one-hot) or a draw from q;
and what seeded draws cost.

Both are lossless. Drawing from q accepts sum_x min(p(x), q(x)) a draft; the argmax x accepts
p(x). Which is larger depends on how well q matches p, so it is measured: SmolLM2-135M with the
shipped feature drafter alone (no context matching, k = 4 fixed), on first user turns of the
validation conversations (`traffic.VALIDATION_RANGE`, never trained on, the split that chooses
settings), at several temperatures / top-p, each policy decoding the same prompts with the same
seeds, in interleaved rounds. Those two run with `EngineConfig.seeded_draws` off (the seed fixes
speculative sampling's random stream); the third policy, `seeded`, is what a seeded request gets
by default: each token its seed's Gumbel-max draw, the drafter drawing with the same noise
(`specd.model.seeded_draws`), which makes the answer independent of the drafts at the price of a
coupling that matches less often than speculative sampling's. For each run it also replays the
learner's gate on the recorded trajectories (`FeatureObjective.simulate`: each draft's exact
acceptance Σ min(p, q) on sampled records) and the gate as it was (greedy proposals walked along
the one recorded draw), and reports how far each estimate is from the accept length served.
Writes benchmarks/results/sampled_drafts.json and prints a table.

    python benchmarks/sampled_drafts.py                 # about 40 minutes on 2 cores
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import cell, interleaved, markdown_table, paired, parser, spread, write_result

from specd.core.traffic import VALIDATION_RANGE, iter_conversations_in
from specd.drafter.base import SAMPLED_DRAFTS
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.pretrained import SHIPPED_DRAFTER, load_pretrained
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.learner.objectives import FeatureObjective
from specd.learner.simulation import simulated_counts
from specd.model.target import LoadedTarget

SETTINGS = ((0.7, 1.0), (1.0, 1.0), (0.7, 0.9))   # (temperature, top_p)
K = 4
# policy -> (how the drafter drafts for sampled rows, seeded draws)
POLICIES = {"argmax": ("argmax", False), "sample": ("sample", False), "seeded": ("sample", True)}
assert {drafts for drafts, _ in POLICIES.values()} == set(SAMPLED_DRAFTS)


def validation_prompts(loaded: LoadedTarget, count: int) -> list[list[int]]:
    prompts = []
    for _, messages in iter_conversations_in(VALIDATION_RANGE):
        text = messages[0]["content"]
        if 20 <= len(text) <= 600 and text.isascii():
            prompts.append(loaded.encode(text, chat=True))
        if len(prompts) == count:
            break
    return prompts


def one_run(loaded: LoadedTarget, objective: FeatureObjective, prompts: list[list[int]], policy: str,
            temperature: float, top_p: float, max_tokens: int, seed: int) -> dict[str, Any]:
    model = load_pretrained(SHIPPED_DRAFTER, loaded.model, loaded.fingerprint)
    sampled_drafts, seeded_draws = POLICIES[policy]
    drafter = FeatureDrafter(model, sampled_drafts=sampled_drafts)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=8, num_draft_tokens=K, adaptive_lookahead=False,
                                                        eos_token_ids=loaded.eos_token_ids, seeded_draws=seeded_draws))
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed * 1000 + i)
              for i in range(len(prompts))]
    begin = time.perf_counter()
    seqs = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - begin
    passes = sum(len(s.steps) for s in seqs)
    emitted = sum(len(s.output_ids) for s in seqs)
    served = emitted / passes
    records = [record_from_sequence(s, "bench", time.time()) for s in seqs]
    # the gate as it was: greedy proposals walked along the one recorded draw
    sequences = [(torch.tensor((r.prompt_ids + r.output_ids)[:-1]), f, len(r.prompt_ids))
                 for r, f in zip(records, objective.features(records), strict=True)]
    argmax_walk = simulated_counts(model, sequences, K).accept_length or 0.0
    replayed = objective.simulate(model, records, K).accept_length or 0.0  # the gate now
    return {"served_accept_length": served, "replayed_accept_length": replayed, "gate_error": replayed - served,
            "argmax_walk_accept_length": argmax_walk, "argmax_walk_error": argmax_walk - served,
            "tokens_per_s": emitted / seconds, "tokens": emitted}


def main() -> None:
    p = parser(__doc__, "benchmarks/results/sampled_drafts.json", repeats=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    loaded = LoadedTarget.load()
    shipped = load_pretrained(SHIPPED_DRAFTER, loaded.model, loaded.fingerprint)
    objective = FeatureObjective(loaded.model, shipped.draft_ids, shipped.config.capture_layers)
    prompts = validation_prompts(loaded, args.prompts)
    result: dict[str, Any] = {"prompts": len(prompts), "k": K, "settings": {}}
    rows = []
    for temperature, top_p in SETTINGS:
        configs = {policy: (lambda r, policy=policy, temperature=temperature, top_p=top_p: one_run(
                       loaded, objective, prompts, policy, temperature, top_p, args.max_tokens, r))
                   for policy in POLICIES}
        runs = interleaved(configs, args.repeats, label=f"T={temperature} top_p={top_p}: ")
        name = f"T={temperature}, top_p={top_p}"
        summary = {policy: {field: spread([run[field] for run in runs[policy]])
                            for field in ("served_accept_length", "replayed_accept_length", "gate_error",
                                          "argmax_walk_error", "tokens_per_s")} for policy in POLICIES}
        for ratio, (top, bottom) in {"argmax_over_sample": ("argmax", "sample"),
                                     "seeded_over_sample": ("seeded", "sample")}.items():
            summary[ratio] = {field: paired(runs, top, bottom, field)
                              for field in ("served_accept_length", "tokens_per_s")}
        result["settings"][name] = {"runs": runs, "summary": summary}
        for policy in POLICIES:
            s = summary[policy]
            rows.append([name, policy, cell(s["served_accept_length"], 3), cell(s["replayed_accept_length"], 3),
                         cell(s["gate_error"], 3), cell(s["argmax_walk_error"], 3), cell(s["tokens_per_s"], 1)])
        for ratio, label in (("argmax_over_sample", "argmax / sample"), ("seeded_over_sample", "seeded / sample")):
            rows.append([name, label, cell(summary[ratio]["served_accept_length"], 3), "", "", "",
                         cell(summary[ratio]["tokens_per_s"], 3)])
    table = markdown_table(["setting", "sampled rows draft (policy)", "served accept length", "gate's replay",
                            "replay − served", "argmax walk − served (the old gate)", "tokens/s"], rows)
    result["table"] = table
    path = write_result(args.out, args, result)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
