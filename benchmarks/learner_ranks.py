"""Learner throughput against data-parallel ranks: recomputed and trained tokens/s, 1 and 2 ranks here.

The record stream is what vLLM's servers send: token ids only, so the learner recomputes the
target's features (SmolLM2-135M, the shipped feature drafter's three layers) before it trains.
Records are ShareGPT conversations from the demo's range (a user turn as the prompt, the
answer as the output, cut at `--prompt-tokens` / `--output-tokens`), dealt to the ranks in turn
as an MQTT shared subscription deals them. Each configuration starts its ranks afresh
(`torch.distributed`, gloo, one process per rank pinned to its cores, `specd.learner.ranks`):
- recomputation: each rank recomputes its share (padded batches, `FeatureObjective.features`);
  the stream is done when the slowest rank is, so throughput = all tokens / the slowest rank's time;
- training: `--steps` optimiser steps of the online objective with DistributedDataParallel
  (every rank's batch in each step), trained tokens/s over all ranks;
- the reduction: the time of one all-reduce of the drafter's gradients, alone.
Configurations: 1 rank on 1 core, 1 rank on 2 cores (one process, two threads: what a single
learner gets from this machine) and 2 ranks on 1 core each, in interleaved rounds. A scaling
table for more ranks follows on paper from the measured per-rank time and reduction cost; its
assumptions are written beside it. Writes benchmarks/results/learner_ranks.json and a table.

    python benchmarks/learner_ranks.py          # about 6 minutes on 2 cores
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import cell, field_spreads, interleaved, markdown_table, paired, parser, write_result

CONFIGS = {"1 rank, 1 core": (1, 1), "1 rank, 2 cores": (1, 2), "2 ranks, 1 core each": (2, 1)}


def stream_of_records(count: int, prompt_tokens: int, output_tokens: int) -> list[Any]:
    from specd.core.records import TrajectoryRecord
    from specd.core.traffic import iter_conversations_in
    from specd.model.target import LoadedTarget

    loaded = LoadedTarget.load()
    records = []
    for _, messages in iter_conversations_in(range(0, 6000)):
        if len(messages) < 2 or not messages[0]["content"].strip() or not messages[1]["content"].strip():
            continue
        prompt = loaded.encode(messages[0]["content"], chat=True)[:prompt_tokens]
        output = loaded.encode(messages[1]["content"])[:output_tokens]
        if len(prompt) >= 8 and len(output) >= 16:
            records.append(TrajectoryRecord(uuid.uuid4().hex, "bench", prompt, output, [], 0.0, 1.0,
                                            time.time(), time.time(), "chat"))
        if len(records) == count:
            return records
    return records


def rank_main(rank: int, world: int, cores: int, port: int, records_path: str, steps: int,
              results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    from specd.drafter.checkpoint import clone_drafter
    from specd.drafter.pretrained import SHIPPED_DRAFTER, load_pretrained
    from specd.learner.config import LearnerConfig, LearnerStats
    from specd.learner.ranks import RankGroup, RankInfo
    from specd.learner.trainer import Trainer
    from specd.model.target import LoadedTarget

    group = RankGroup(RankInfo(rank, world, rank), cores_per_rank=cores)
    loaded = LoadedTarget.load()
    model = clone_drafter(load_pretrained(SHIPPED_DRAFTER, loaded.model, loaded.fingerprint)).float().train()
    trainer = Trainer(model, LearnerConfig(seed=rank), loaded.model, group=group)
    records = pickle.loads(Path(records_path).read_bytes())[rank::world]
    dist.barrier()
    begin = time.perf_counter()
    trainer.objective.features(records)
    recompute_s = time.perf_counter() - begin
    dist.barrier()
    stats = LearnerStats()
    trainer.step(trainer.batch(records), stats, None)  # warm-up step, not timed
    dist.barrier()
    begin = time.perf_counter()
    tokens_before = stats.tokens_trained
    for _ in range(steps):
        trainer.step(trainer.batch(records), stats, None)
    train_s = time.perf_counter() - begin
    flat = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    dist.barrier()
    begin = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(flat)
    reduce_s = (time.perf_counter() - begin) / 5
    results.put({"rank": rank, "records": len(records), "tokens": sum(len(r.prompt_ids) + len(r.output_ids) - 1
                                                                     for r in records),
                 "recompute_s": recompute_s, "train_s": train_s,
                 "tokens_trained": stats.tokens_trained - tokens_before, "reduce_s": reduce_s,
                 "gradient_bytes": flat.numel() * flat.element_size(), "threads": torch.get_num_threads()})
    group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(world: int, cores: int, records_path: str, steps: int) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, world, cores, port, records_path, steps, results))
             for r in range(world)]
    for process in ranks:
        process.start()
    parts = [results.get(timeout=900) for _ in ranks]
    for process in ranks:
        process.join(timeout=60)
    tokens = sum(p["tokens"] for p in parts)
    slowest = max(p["recompute_s"] for p in parts)
    train_s = max(p["train_s"] for p in parts)
    return {"recomputed_tokens_per_s": tokens / slowest, "trained_tokens_per_s":
            sum(p["tokens_trained"] for p in parts) / train_s,
            "step_s": train_s / steps, "reduce_s": max(p["reduce_s"] for p in parts),
            "per_rank_recompute_tokens_per_s": [p["tokens"] / p["recompute_s"] for p in parts],
            "gradient_bytes": parts[0]["gradient_bytes"], "threads": [p["threads"] for p in parts], "ranks": world}


def on_paper(one_core: dict[str, Any], two_ranks: dict[str, Any]) -> list[list[Any]]:
    """More ranks, from the measured per-rank figures: recomputation is per record, so N ranks
    recompute N times one rank's rate; a step costs one rank's step time plus a ring all-reduce,
    whose cost grows as 2 (N - 1) / N times the gradient bytes over the measured bandwidth."""
    per_rank = one_core["recomputed_tokens_per_s"]["median"]
    step = one_core["step_s"]["median"]
    reduce_2 = two_ranks["reduce_s"]["median"]
    rows = []
    for n in (1, 2, 4, 8, 16):
        reduce_n = reduce_2 * 2 * (n - 1) / n  # the ring's factor is 1 at the measured 2 ranks, 0 alone
        efficiency = step / (step + reduce_n)
        rows.append([n, round(per_rank * n), round(reduce_n * 1000, 1), round(efficiency, 3)])
    return rows


def main() -> None:
    p = parser(__doc__, "benchmarks/results/learner_ranks.json", repeats=2)
    p.add_argument("--records", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "records.pkl"
        records = stream_of_records(args.records, args.prompt_tokens, args.output_tokens)
        path.write_bytes(pickle.dumps(records))
        configs = {name: (lambda _, w=w, c=c: one_run(w, c, str(path), args.steps))
                   for name, (w, c) in CONFIGS.items()}
        runs = interleaved(configs, args.repeats)
    fields = ["recomputed_tokens_per_s", "trained_tokens_per_s", "step_s", "reduce_s"]
    summary = field_spreads(runs, fields)
    ratios = {f"2 ranks / {base}": {f: paired(runs, "2 ranks, 1 core each", base, f)
                                    for f in ("recomputed_tokens_per_s", "trained_tokens_per_s")}
              for base in ("1 rank, 1 core", "1 rank, 2 cores")}
    rows = [[name, cell(s["recomputed_tokens_per_s"], 0), cell(s["trained_tokens_per_s"], 0),
             cell(s["step_s"], 2), cell(s["reduce_s"], 4)] for name, s in summary.items()]
    table = markdown_table(["configuration", "recomputed tokens/s", "trained tokens/s", "step (s)",
                            "all-reduce (s)"], rows)
    ratio_rows = [[name, cell(r["recomputed_tokens_per_s"], 2), cell(r["trained_tokens_per_s"], 2)]
                  for name, r in ratios.items()]
    ratio_table = markdown_table(["per-round ratio", "recomputed tokens/s", "trained tokens/s"], ratio_rows)
    paper = markdown_table(["ranks", "recomputed tokens/s (N x one core's)", "all-reduce per step (ms)",
                            "training step efficiency"],
                           on_paper(summary["1 rank, 1 core"], summary["2 ranks, 1 core each"]))
    result = {"records": len(records), "tokens": sum(r.num_tokens for r in records), "runs": runs,
              "summary": summary, "ratios": ratios, "table": table, "ratio_table": ratio_table,
              "on_paper": paper}
    write_result(args.out, args, result)
    print(table, ratio_table, paper, sep="\n\n")


if __name__ == "__main__":
    main()
