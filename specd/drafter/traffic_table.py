"""A continuation table learned from served traffic: what followed each short context, across requests.

Contract: `TrafficTable.add(tokens)` counts, at every position of a finished sequence, the token
that followed each context of min_n..max_n tokens (at most `max_candidates` continuations per
context; beyond `max_contexts` the oldest contexts are dropped, so memory stays bounded).
`draft(sequence, k)` chains up to k tokens: each is the most frequent continuation of the
longest context the table knows that ends at it, and the chain stops where the table knows no
context or its best continuation is uncertain (seen fewer than `min_count` times or less than
`min_share` of the time). Unlike context matching, which looks only inside the request, this
carries what earlier requests taught (templates, code idioms, stock phrases) to new ones; it
learns the moment a request finishes, with no training step. One writer thread and one reader
thread may share it: both take its lock, the writer per chunk of positions, so a read never
waits long. `stats()` says how full it is; a context costs about 400 bytes (384-421 measured with
tracemalloc on ShareGPT text: 115-126 MB at the default bound; `benchmarks/server_memory.py`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class TrafficTable:
    def __init__(self, min_n: int = 2, max_n: int = 4, max_contexts: int = 300_000, max_candidates: int = 4,
                 min_count: int = 2, min_share: float = 0.5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"traffic table needs 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_contexts, self.max_candidates = max_contexts, max_candidates
        self.min_count, self.min_share = min_count, min_share
        # ordered by insertion, the oldest first; an OrderedDict because evicting from the front of a
        # plain dict leaves holes that every later `next(iter(...))` walks again (seconds per add, once full)
        self._counts: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.sequences_added = 0

    def __len__(self) -> int:
        return len(self._counts)

    def stats(self) -> dict[str, int]:
        """What an operator reads to see how full the table is (its memory grows with `contexts`)."""
        return {"contexts": len(self._counts), "max_contexts": self.max_contexts,
                "sequences_added": self.sequences_added}

    def add(self, tokens: Sequence[int], chunk: int = 256) -> None:
        tokens = [int(t) for t in tokens]
        # the lock is taken per chunk of positions, so a reader (a decoding step) never waits for a
        # whole long sequence to be counted
        for begin in range(self.min_n, len(tokens), chunk):
            with self._lock:
                self._count(tokens, begin, min(begin + chunk, len(tokens)))
        with self._lock:
            while len(self._counts) > self.max_contexts:
                self._counts.popitem(last=False)  # the oldest context goes
            self.sequences_added += 1

    def _count(self, tokens: list[int], begin: int, end: int) -> None:
        counts = self._counts
        for position in range(begin, end):
            following = tokens[position]
            for n in range(self.min_n, min(self.max_n, position) + 1):
                context = tuple(tokens[position - n:position])
                seen = counts.get(context)
                if seen is None:
                    counts[context] = {following: 1}
                elif following in seen:
                    seen[following] += 1
                elif len(seen) < self.max_candidates:
                    seen[following] = 1
                else:  # full: the rarest candidate gives way, keeping counts of the frequent ones exact
                    rarest = min(seen, key=seen.__getitem__)
                    seen[following] = seen.pop(rarest)

    def draft(self, sequence: Sequence[int], k: int) -> list[int]:
        return self.draft_with_order(sequence, k)[0]

    def draft_with_order(self, sequence: Sequence[int], k: int) -> tuple[list[int], int]:
        """(drafts, n): n is the length of the context that chose the first draft (0: none)."""
        window = [int(t) for t in sequence[-self.max_n:]]
        drafts: list[int] = []
        first_order = 0
        with self._lock:
            for _ in range(k):
                token, order = self._next(window)
                if token is None:
                    break
                first_order = first_order or order
                drafts.append(token)
                window = [*window[1:], token] if len(window) >= self.max_n else [*window, token]
        return drafts, first_order

    def _next(self, window: list[int]) -> tuple[int | None, int]:
        for n in range(min(self.max_n, len(window)), self.min_n - 1, -1):
            seen = self._counts.get(tuple(window[len(window) - n:]))
            if seen:  # the longest known context decides; a shorter one is only a fallback for unknown ones
                token = max(seen, key=seen.__getitem__)
                count = seen[token]
                if count >= self.min_count and count >= self.min_share * sum(seen.values()):
                    return token, n
                return None, n
        return None, 0
