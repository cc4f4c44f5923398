"""Which loss trains the feature drafter better: forward KL or the acceptance objective.

Both start from the same day-0 drafter (`new_feature_drafter`, the same seed) and train on the
same cached target features of ShareGPT conversations of the training range (the first
stages of `specd pretrain --data sharegpt`, in their own work folder), with the same batches in
the same order, for `--steps` steps; every `--eval-every` steps each is scored by its exact greedy
accept length (k = 4) on the validation prompts' own greedy continuations (the split that chooses
settings; the evaluation split is left alone). Objectives: "kl" = KL(p_target || q) at
every position and unrolled step; "accept" = −log Σ_x min(p(x), q(x)), the log of the chance that
a sampled draft is accepted. The default in `PretrainConfig.objective` follows this benchmark.
Writes out/objectives.json and prints the curves side by side.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, parser, write_result

from specd.drafter.feature_model import FeatureDrafterConfig, new_feature_drafter
from specd.learner.feature_signal import collate, feature_loss, label_rows
from specd.model.target import LoadedTarget
from specd.offline.pretrain import PretrainConfig, held_out_sets, training_corpus
from specd.offline.training_loop import held_out_accept_length

OBJECTIVES = ("kl", "accept")


def main() -> None:
    p = parser(__doc__, "out/objectives.json", repeats=1)
    p.add_argument("--work", default="out/objectives-work", help="cached features (reused across runs)")
    p.add_argument("--conversations", type=int, default=150)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=PretrainConfig.learning_rate)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = LoadedTarget.load()
    target = loaded.model
    config = PretrainConfig(data="sharegpt", conversations=args.conversations, max_length=256, eval_prompts=12,
                            eval_tokens=64, shard_size=50)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    capture = FeatureDrafterConfig.for_target(target.config, config.draft_vocab).capture_layers
    corpus = training_corpus(loaded, config, capture, work)
    day0 = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                               corpus.draft_ids, seed=0)
    validation = held_out_sets(loaded, config, capture, work)["validation"]
    rows = label_rows(target.lm_head.weight, day0.draft_ids, target.norm.weight)
    models = {name: day0.clone().float().train() for name in OBJECTIVES}
    optimisers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95)) for name, m in models.items()}
    curves: dict[str, list[dict[str, Any]]] = {name: [] for name in OBJECTIVES}
    rng = random.Random(0)
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            for name, model in models.items():
                curves[name].append({"step": step, "accept_length": held_out_accept_length(model, validation, 4)})
            print(step, {name: curve[-1]["accept_length"] for name, curve in curves.items()}, flush=True)
        if step == args.steps:
            break
        picked = rng.sample(range(len(corpus.sequences)), args.batch)
        batch = collate([(corpus.sequences[i], corpus.features[i], corpus.weights[i]) for i in picked])
        for name, model in models.items():
            loss, stats = feature_loss(model, batch, rows, config.unroll, config.step_decay, name)
            optimisers[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimisers[name].step()
            if (step + 1) % args.eval_every == 0:
                curves[name].append({"step": step + 1, "train_kl1": stats.get("kl1"),
                                     "train_top1": stats.get("top1_1")})
    result = {"curves": curves, "tokens_per_step": "batch × ≤256", "conversations": len(corpus.sequences)}
    write_result(args.out, args, result)
    scored = {name: [c for c in curve if "accept_length" in c] for name, curve in curves.items()}
    table = [[point["step"], *(f"{scored[name][i]['accept_length']:.3f}" for name in OBJECTIVES)]
             for i, point in enumerate(scored["kl"])]
    print(markdown_table(["step", *(f"accept length, {name}" for name in OBJECTIVES)], table))


if __name__ == "__main__":
    main()
