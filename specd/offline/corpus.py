"""The data of `specd pretrain`: training corpora, the validation and evaluation sets, their hashes.

Contract: every set is built once in the work folder and reused by a resumed run.
- Training corpus (`TrainingCorpus`): token ids, the target's features (fp16) and a label weight per
  position, plus the draft vocabulary ranked by frequency in it. Two sources, both from
  `traffic.TRAINING_RANGE` only: "distilled", the target's own responses to the conversations'
  user turns (`specd.offline.distill`, features captured in the generating passes; response
  positions weigh 1, prompt positions `prompt_weight`), or "sharegpt", the conversations' own text
  (GPT-3.5's words), features from one pass per conversation, every position weighing 1.
- Held-out sets (`held_out_set`): first user turns of conversations in a span, each with the target's
  own greedy continuation and its features (the traffic a day-0 drafter serves). The validation
  set comes from `traffic.VALIDATION_RANGE` (never trained on) and chooses settings; the evaluation
  set comes from `traffic.EVALUATION_START` on and only reports.
- `tensor_hash` fingerprints a set's token ids, for the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specd.core.errors import ConfigurationError
from specd.core.traffic import TRAINING_RANGE, is_short_chat_turn, iter_conversations_in, iter_training_conversations
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget
from specd.offline.distill import DistillConfig, distill

log = logging.getLogger(__name__)

SOURCES = ("distilled", "sharegpt")
HeldOut = list[tuple[torch.Tensor, torch.Tensor, int]]  # (tokens [T], features [T, F], prompt length)


@dataclass
class TrainingCorpus:
    sequences: list[torch.Tensor]   # token ids per example
    features: list[torch.Tensor]    # [T, F] fp16 per example
    weights: list[torch.Tensor]     # [T] label weight per position
    draft_ids: torch.Tensor         # the draft vocabulary, most frequent first
    coverage: dict[str, float]      # share of tokens covered by the top N ids
    description: str

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def tensor_hash(tensors: list[torch.Tensor]) -> str:
    """sha256 over the sequences' int64 ids with their lengths (the same data, the same hash)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        ids = tensor.to(torch.int64).contiguous()
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


def rank_vocabulary(sequences: list[torch.Tensor], vocab_size: int,
                    draft_vocab: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The `draft_vocab` most frequent ids (ties and unseen ids in id order) and their coverage."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.tolist())
    ranked = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen]
    total = max(1, sum(counts.values()))
    coverage = {str(n): sum(c for _, c in counts.most_common(n)) / total
                for n in (1024, 2048, 4096, 8192, 16384) if n <= vocab_size}
    return torch.tensor(ranked[:min(draft_vocab, vocab_size)]), coverage


def distilled_corpus(generator: LoadedTarget, distill_config: DistillConfig, capture: tuple[int, ...],
                     draft_vocab: int, prompt_weight: float, work: Path, greedy_only: bool = False) -> TrainingCorpus:
    """The target's own responses (generated, or read back from `work`/distilled); with
    `greedy_only`, the greedy ones only (the draft vocabulary is still ranked on all of them, so
    that arms compared on the same generated data draft over the same ids)."""
    examples = distill(generator, distill_config, capture, work / "distilled")
    sequences, features, weights = [], [], []
    for example in examples:
        assert example.conversation in TRAINING_RANGE, "distillation read outside the training range"
        tokens = example.tokens[:-1]  # the last token is never an input: its features are not captured
        weight = torch.full((len(tokens),), float(prompt_weight))
        # weight[i] weighs the label at entry i - 1, the draft of token i + 1: a response token
        weight[max(0, example.prompt_length - 1):] = 1.0
        sequences.append(tokens)
        features.append(example.features)
        weights.append(weight)
    draft_ids, coverage = rank_vocabulary(sequences, generator.model.config.vocab_size, draft_vocab)
    if greedy_only:
        kept = [i for i, example in enumerate(examples) if example.temperature == 0]
        sequences, features, weights = ([items[i] for i in kept] for items in (sequences, features, weights))
        examples = [examples[i] for i in kept]
        if not examples:
            raise ConfigurationError("--greedy-only keeps none of these answers: all are sampled (only round 0 "
                                     "has greedy ones, and --first-round leaves it out); leave --greedy-only out")
    sampled = sum(1 for e in examples if e.temperature > 0)
    description = (f"the target's own responses to {len(examples)} user turns of ShareGPT conversations "
                   f"{TRAINING_RANGE.start}-{TRAINING_RANGE.stop - 1} ({len(examples) - sampled} greedy, "
                   f"{sampled} sampled at temperature {distill_config.temperature})")
    return TrainingCorpus(sequences, features, weights, draft_ids, coverage, description)


MIN_SEQUENCE = 16   # tokens a ShareGPT conversation needs to be trained on (shorter ones are left out)


def sharegpt_corpus(loaded: LoadedTarget, conversations: int, max_length: int, draft_vocab: int,
                    capture: tuple[int, ...], shard_size: int, work: Path) -> TrainingCorpus:
    """ShareGPT's own text of the first `conversations` training conversations, cut at `max_length`."""
    path = work / "data.safetensors"
    if path.is_file():
        tensors = load_file(str(path))
        offsets = tensors["offsets"].tolist()
        sequences = [tensors["tokens"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        draft_ids, coverage = tensors["draft_ids"], json.loads((work / "data.json").read_text())["coverage"]
    else:
        sequences = []
        for messages in tqdm(iter_training_conversations(), total=conversations, desc="tokenising", unit="conv"):
            ids = loaded.tokenizer.apply_chat_template(messages, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            ids = [int(t) for t in ids][:max_length]
            if len(ids) >= MIN_SEQUENCE:
                sequences.append(torch.tensor(ids))
            if len(sequences) >= conversations:
                break
        if not sequences:
            raise ConfigurationError(f"no ShareGPT training conversation has {MIN_SEQUENCE} tokens within "
                                     f"--max-length {max_length}")
        draft_ids, coverage = rank_vocabulary(sequences, loaded.model.config.vocab_size, draft_vocab)
        offsets = [0]
        for seq in sequences:
            offsets.append(offsets[-1] + len(seq))
        save_file({"tokens": torch.cat(sequences), "offsets": torch.tensor(offsets), "draft_ids": draft_ids},
                  str(path))
        (work / "data.json").write_text(json.dumps({"conversations": len(sequences), "coverage": coverage}))
    features = cached_features(loaded, sequences, capture, shard_size, work)
    description = (f"ShareGPT's own text of {len(sequences)} conversations from {TRAINING_RANGE.start}-"
                   f"{TRAINING_RANGE.stop - 1}, cut at {max_length} tokens")
    return TrainingCorpus(sequences, features, [torch.ones(len(s)) for s in sequences], draft_ids, coverage,
                          description)


def cached_features(loaded: LoadedTarget, sequences: list[torch.Tensor], capture: tuple[int, ...],
                    shard_size: int, work: Path) -> list[torch.Tensor]:
    """The target's features of every sequence, fp16, from shards (computing missing shards)."""
    layout = work / "features.json"  # which layers the cached shards hold: a mismatch is refused
    wanted = {"capture_layers": list(capture)}
    if layout.is_file() and json.loads(layout.read_text()) != wanted:
        raise ConfigurationError(f"{work} caches features of {json.loads(layout.read_text())}, this drafter reads "
                                 f"{wanted}: use another work folder")
    layout.write_text(json.dumps(wanted))
    features: list[torch.Tensor] = []
    for first in tqdm(range(0, len(sequences), shard_size), desc="target features", unit="shard"):
        path = work / f"features-{first // shard_size:04d}.safetensors"
        group = sequences[first:first + shard_size]
        if not path.is_file():
            partial = path.with_suffix(".partial")
            save_file({str(i): target_features(loaded.model, seq, capture) for i, seq in enumerate(group)},
                      str(partial))
            partial.replace(path)
        stored = load_file(str(path))
        features += [stored[str(i)] for i in range(len(group))]
    return features


@torch.inference_mode()
def target_features(model: Any, tokens: torch.Tensor, capture: tuple[int, ...]) -> torch.Tensor:
    """[T, feature_size] fp16 features of one sequence (one whole-sequence pass, no cache)."""
    return model.train_features(tokens[None].to(model.embed.weight.device), capture)[0].to(torch.float16).cpu()


def first_user_turns(span: range, count: int, max_chars: int = 600) -> list[str]:
    """The first user turns of the first `count` conversations in `span` (file order) that
    `traffic.is_short_chat_turn` keeps, as the demo's prompts are kept."""
    texts = []
    for _, messages in iter_conversations_in(span):
        text = messages[0]["content"]
        if is_short_chat_turn(text, max_chars):
            texts.append(text)
            if len(texts) >= count:
                break
    return texts


def greedy_continuations(loaded: LoadedTarget, prompts: list[list[int]], max_tokens: int,
                         capture: tuple[int, ...]) -> HeldOut:
    """The target's own greedy continuations of `prompts` with their features: what a drafter serves."""
    engine = Engine(loaded.model, None, EngineConfig(max_batch=8, eos_token_ids=loaded.eos_token_ids,
                                                     prefill_chunk=None))  # offline: whole prompts, as made before
    made = []
    for prompt, seq in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=max_tokens)), strict=True):
        tokens = torch.tensor(prompt + seq.output_ids)
        made.append((tokens, target_features(loaded.model, tokens, capture), len(prompt)))
    return made


def held_out_set(loaded: LoadedTarget, span: range, count: int, max_tokens: int, capture: tuple[int, ...],
                 path: Path) -> HeldOut:
    """Prompts from `span` with the target's greedy continuations and their features (cached at `path`)."""
    if not path.is_file():
        room = loaded.model.config.max_position - max_tokens
        encoded = (loaded.encode_messages([{"role": "user", "content": text}])
                   for text in first_user_turns(span, 4 * count))
        prompts = [ids for ids in encoded if len(ids) <= room][:count]  # a small target's context may be short
        log.info("generating %d greedy continuations for %s", len(prompts), path.name)
        tensors: dict[str, torch.Tensor] = {}
        for i, (tokens, features, prompt_length) in enumerate(greedy_continuations(loaded, prompts, max_tokens,
                                                                                   capture)):
            tensors[f"tokens{i}"] = tokens
            tensors[f"features{i}"] = features
            tensors[f"prompt{i}"] = torch.tensor([prompt_length])
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial))
        partial.replace(path)
    return load_held_out(path)


def load_held_out(path: Path) -> HeldOut:
    """A held-out set as `held_out_set` wrote it."""
    stored = load_file(str(path))
    total = sum(1 for name in stored if name.startswith("tokens"))
    return [(stored[f"tokens{i}"], stored[f"features{i}"], int(stored[f"prompt{i}"][0])) for i in range(total)]
