"""Context matching (prompt lookup): propose what followed the last earlier occurrence of the suffix.

Contract: `context_match_drafts(sequence, k, max_n, min_n)` looks for the longest suffix of the
row's tokens (max_n down to min_n tokens) that occurred earlier in the same row, most recent
occurrence first, and returns up to k tokens that followed it; an empty list when nothing
matches. Deterministic and free of training: code and chat answers repeat their prompt often.
`specd.drafter.hybrid.HybridDrafter` puts it in front of the learned drafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def context_match(sequence: Sequence[int] | np.ndarray, k: int, max_n: int = 4, min_n: int = 2
                  ) -> tuple[list[int], int]:
    """(drafts, n): what followed the latest earlier occurrence of the longest matching n-token suffix."""
    tokens = np.asarray(sequence)
    length = len(tokens)
    # an earlier occurrence of the n-token suffix ends at some j <= length - 2 with tokens[j] == the
    # last token: filter those candidates one token further back per round (vectorised, no Python scan)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if length > 1 else np.empty(0, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        matching = ends[ends >= n - 1]
        for back in range(1, n):
            matching = matching[tokens[matching - back] == tokens[length - 1 - back]]
        if len(matching):
            end = int(matching[-1])  # the most recent earlier occurrence predicts best
            return [int(t) for t in tokens[end + 1:end + 1 + k]], n
    return [], 0


def context_match_drafts(sequence: Sequence[int] | np.ndarray, k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    return context_match(sequence, k, max_n, min_n)[0]
