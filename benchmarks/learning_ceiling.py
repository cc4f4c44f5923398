"""How far can a few dozen code records move the drafter? Learner settings and a nearest-neighbour memory.

Issue 19 asks the demo's adaptive mode for 1.25x static's accept length on its second domain
(HumanEval) within the demo's 20 code requests. This benchmark measures what learning can give
there, on validation problems the demo never serves (`demo_learner_sweep.validation_items`):
SmolLM2 answers `--records` + `--tune` + `--check` problems greedily with no drafter; the first
`--records` become training records, fed to the service's own `Learner` (`DEMO_LEARNER`'s
settings, gate and publishing off) `--per-round` at a time with a number of steps after each;
the learned drafter alone is then replayed greedily at k = 4 on the held-out problems (exact,
`specd.learner.simulation`) after the records named in `--marks`. `tune` is where a setting would
be chosen, `check` where it is confirmed: a setting that only wins on `tune` is noise.

Arms (`--arms`): `demo` (DEMO_LEARNER, 12 steps a round, about the demo's learner), `steps30` (30
steps a round), `lr3e-4` and `lr3e-4_steps30` (twice the learning rate), `prompt1` (prompt
positions weighed 1, not 0.5), `unroll4` (four chained steps trained, as many as are drafted),
`newest` (every batch from the newest 8 records), and two that test whether more tokens from the
same problems teach more: `sampled3` (each training record comes with 3 answers the target samples
to the same prompt at temperature 0.7, generated before training, as a learner with a copy of the
target could; 48 steps a round for 16 records) and `steps48` (the control: 48 steps a round on the
served records alone).

The memory (`--memory-thresholds`): fast adaptation without training, as kNN-LM adapts a language
model. From the training records, the drafter's own normalised output state at every position and
chain step is a key and the token that followed is its value; while replaying, a draft whose state
is at least `tau` (cosine) from its nearest key of the same chain step is replaced by that key's
token. Built with the day-0 drafter and with each arm's trained one (on the same records).

Writes JSON (default out/learning_ceiling.json) and prints a markdown table.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from common import markdown_table, parser, write_result
from demo_learner_sweep import answer_records, feed_round, make_records, sweep_learner, validation_items

from specd.core.records import TrajectoryRecord
from specd.demo.deployment import DEMO_LEARNER, DemoConfig
from specd.drafter.feature_model import FeatureDrafterModel
from specd.engine.request import SamplingParams
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.simulation import ExpectedCounts, replay_start, walk_passes
from specd.model.target import LoadedTarget

K = 4
ARMS: dict[str, tuple[dict[str, Any], int]] = {
    "demo": ({}, 12),
    "steps30": ({}, 30),
    "lr3e-4": ({"feature_learning_rate": 3e-4}, 12),
    "lr3e-4_steps30": ({"feature_learning_rate": 3e-4}, 30),
    "prompt1": ({"feature_prompt_weight": 1.0}, 12),
    "unroll4": ({"unroll": 4}, 12),
    "newest": ({"recent_share": 1.0, "recent_records": 8}, 12),
    "sampled3": ({}, 48),
    "steps48": ({}, 48),
}
# arms that train on the target's own sampled answers beside each record: (answers, temperature)
SAMPLED_ANSWERS = {"sampled3": (3, 0.7)}
Trajectory = tuple[torch.Tensor, torch.Tensor, int]   # ids (all but the last), features, prompt length
Memory = tuple[list[torch.Tensor], list[torch.Tensor]]  # per chain step: unit keys [N, hidden], values [N]


def trajectories(learner: Learner, records: list[TrajectoryRecord]) -> list[Trajectory]:
    features = learner.objective.features(records)  # type: ignore[attr-defined]
    return [(torch.tensor((r.prompt_ids + r.output_ids)[:-1]), f.float(), len(r.prompt_ids))
            for r, f in zip(records, features, strict=True)]


@torch.no_grad()
def build_memory(model: FeatureDrafterModel, train: list[Trajectory], records: list[TrajectoryRecord]) -> Memory:
    """Keys at the output positions of every training record (entry e predicts token e + 2)."""
    keys: list[list[torch.Tensor]] = [[] for _ in range(K)]
    values: list[list[torch.Tensor]] = [[] for _ in range(K)]
    for (ids, features, prompt_length), record in zip(train, records, strict=True):
        full = torch.tensor(record.prompt_ids + record.output_ids)
        outputs = model.unrolled(features[None, :-1], ids[None, 1:], K)
        for j, state in enumerate(outputs):
            entries = torch.arange(j, state.shape[1])
            entries = entries[(entries + 2 >= prompt_length) & (entries + 2 < len(full))]
            keys[j].append(F.normalize(model.norm(state[0, entries]), dim=-1))
            values[j].append(full[entries + 2])
    return [torch.cat(k) for k in keys], [torch.cat(v) for v in values]


@torch.no_grad()
def replay(model: FeatureDrafterModel, held_out: list[Trajectory], memory: Memory | None = None,
           tau: float = 1.0) -> dict[str, float]:
    """Greedy accept length at k = K, the drafter's argmax replaced by the memory's token where a
    key is within `tau`; and the share of drafts the memory made."""
    counts, replaced, drafted = ExpectedCounts(), 0, 0
    for ids, features, prompt_length in held_out:
        start = replay_start(prompt_length)
        entries = len(ids) - 1
        alphas = []
        for j, state in enumerate(model.unrolled(features[None, :-1], ids[None, 1:], K, start=start)):
            state = state[0]
            predicted = model.draft_ids[model.logits(state).argmax(-1)]
            if memory is not None:
                best, nearest = (F.normalize(model.norm(state), dim=-1) @ memory[0][j].T).max(-1)
                close = best >= tau
                predicted = torch.where(close, memory[1][j][nearest], predicted)
                replaced, drafted = replaced + int(close.sum()), drafted + len(close)
            matched = torch.zeros(entries)
            reach = torch.arange(start, entries - 1)
            matched[reach] = (predicted[reach - start] == ids[reach + 2]).float()
            alphas.append(matched.tolist())
        walk_passes(alphas, prompt_length, len(ids), K, counts)
    return {"accept_length": round(counts.accept_length or 0.0, 4),
            "memory_share": round(replaced / drafted, 4) if drafted else 0.0}


def sampled_answers(loaded: LoadedTarget, records: list[TrajectoryRecord], answers: int, temperature: float,
                    max_tokens: int) -> list[list[TrajectoryRecord]]:
    """Per record, `answers` records of the target's own sampled answers to its prompt (seeded)."""
    prompts = [r.prompt_ids for _ in range(answers) for r in records]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 * answer + i)
              for answer in range(answers) for i in range(len(records))]
    domains = [r.domain or "humaneval" for _ in range(answers) for r in records]
    sampled = answer_records(loaded, prompts, params, domains, server_id="sampled")
    return [sampled[i::len(records)] for i in range(len(records))]


def run_arm(loaded: LoadedTarget, name: str, records: list[TrajectoryRecord], held: dict[str, list[Trajectory]],
            marks: list[int], per_round: int, thresholds: list[float], max_tokens: int) -> dict[str, Any]:
    changes, steps = ARMS[name]
    learner = new_learner(loaded, replace(DEMO_LEARNER, **changes))
    curve: dict[int, dict[str, float]] = {}
    begin = time.perf_counter()
    extra = (sampled_answers(loaded, records[:max(marks)], *SAMPLED_ANSWERS[name], max_tokens)
             if name in SAMPLED_ANSWERS else None)
    generated = time.perf_counter() - begin
    begin += generated  # train_seconds: training and replays, not the generation
    for start in range(0, max(marks), per_round):
        served = records[start:start + per_round]
        if extra is not None:
            served = served + [r for answers in extra[start:start + per_round] for r in answers]
        feed_round(learner, served, steps)
        seen = min(start + per_round, len(records))
        if seen in marks:
            model = drafter_of(learner)
            curve[seen] = {split: replay(model, held_out)["accept_length"] for split, held_out in held.items()}
            learner.model.train()
            print(f"  {name}: {seen} records, " + ", ".join(f"{s} {v:.3f}" for s, v in curve[seen].items()), flush=True)
    seconds = time.perf_counter() - begin
    model = drafter_of(learner)
    train = records[:max(marks)]
    return {"arm": name, "steps_per_round": steps, "changes": changes, "curve": curve,
            "train_seconds": round(seconds, 1), "generation_seconds": round(generated, 1) if extra else None,
            "memory": memory_rows(model, trajectories(learner, train), train, held, thresholds)}


def memory_rows(model: FeatureDrafterModel, train: list[Trajectory], records: list[TrajectoryRecord],
                held: dict[str, list[Trajectory]], thresholds: list[float]) -> dict[str, Any]:
    memory = build_memory(model, train, records)
    return {f"{tau:g}": {split: replay(model, t, memory, tau) for split, t in held.items()} for tau in thresholds}


def drafter_of(learner: Learner) -> FeatureDrafterModel:
    """The learner's training copy in eval mode (the feature drafter: the objective this measures)."""
    model = learner.model.eval()
    assert isinstance(model, FeatureDrafterModel)
    return model


def new_learner(loaded: LoadedTarget, config: LearnerConfig) -> Learner:
    random.seed(config.seed)
    return sweep_learner(loaded, config, tempfile.mkdtemp(prefix="learning-ceiling-"))


def main() -> None:
    p = parser(__doc__, "out/learning_ceiling.json", 1)
    p.add_argument("--records", type=int, default=20, help="training records (the demo serves 20 of code)")
    p.add_argument("--tune", type=int, default=30)
    p.add_argument("--check", type=int, default=30)
    p.add_argument("--marks", default="8,20", help="records after which the held-out problems are replayed")
    p.add_argument("--per-round", type=int, default=4)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--memory-thresholds", default="0.8,0.85,0.9")
    p.add_argument("--max-tokens", type=int, default=DemoConfig.max_tokens)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    marks = sorted(int(m) for m in args.marks.split(","))
    if marks[-1] > args.records:
        raise SystemExit(f"--marks go up to {marks[-1]}, past --records {args.records}")
    thresholds = [float(t) for t in args.memory_thresholds.split(",")]
    loaded = LoadedTarget.load()
    records = make_records(loaded, validation_items(args.records + args.tune + args.check), args.max_tokens)
    train, tune, check = (records[:args.records], records[args.records:args.records + args.tune],
                          records[args.records + args.tune:])
    day0 = new_learner(loaded, DEMO_LEARNER)
    held = {"tune": trajectories(day0, tune), "check": trajectories(day0, check)}
    day0_model = drafter_of(day0)
    baseline = {split: replay(day0_model, t)["accept_length"] for split, t in held.items()}
    print("day 0: " + ", ".join(f"{s} {v:.3f}" for s, v in baseline.items()), flush=True)
    day0_memory = memory_rows(day0_model, trajectories(day0, train[:marks[-1]]), train[:marks[-1]], held, thresholds)
    arms = [run_arm(loaded, name, train, held, marks, args.per_round, thresholds, args.max_tokens)
            for name in args.arms.split(",")]
    rows = [["day 0", "-", f"{baseline['tune']:.3f}", f"{baseline['check']:.3f}", best_memory(day0_memory)]]
    for arm in arms:
        rows.append([arm["arm"], arm["steps_per_round"],
                     " / ".join(f"{arm['curve'][m]['tune']:.3f}" for m in marks),
                     " / ".join(f"{arm['curve'][m]['check']:.3f}" for m in marks), best_memory(arm["memory"])])
    print(markdown_table(["arm", "steps a round", f"tune after {marks}", f"check after {marks}",
                          "with memory (tau chosen on tune): check"], rows))
    write_result(args.out, args, {"records": len(train), "tune": len(tune), "check": len(check), "k": K,
                                  "marks": marks, "day0": baseline, "day0_memory": day0_memory, "arms": arms})


def best_memory(rows: dict[str, Any]) -> str:
    """The threshold that did best on tune, and what it gave on check."""
    tau = max(rows, key=lambda t: rows[t]["tune"]["accept_length"])
    check = rows[tau]["check"]
    return f"{check['accept_length']:.3f} (tau {tau}, {check['memory_share']:.0%} of drafts)"


if __name__ == "__main__":
    main()
