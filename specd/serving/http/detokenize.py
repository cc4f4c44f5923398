"""Streamed text from token ids: incremental detokenisation and stop strings, with bounded work per token.

Contract: `IncrementalDetokenizer.push(ids)` returns the text that new output ids add, decoding
only a short window of recent tokens, never the whole output again, so the work per token does
not grow with the output's length (the prefix-offset / read-offset scheme of vLLM and TGI: the
window starts at the tokens of the last emitted piece, decoded again as context for the new
ones). Text whose window ends in U+FFFD may be an incomplete UTF-8 character and is held back
until more tokens complete it; past `max_pending` held tokens the window is cut where cutting
provably changes nothing. `finish()` returns what is still held. For a byte-level tokenizer (a
token's text is its bytes, decoded as UTF-8 with replacement; special tokens skipped) the pieces
of every `push` and the `finish` concatenate to exactly `decode(all ids)`.

`StopStrings` cuts streamed text before the first stop string, also one that spans two pieces,
by holding back the last len(longest stop) - 1 characters until the next piece shows whether
they begin a stop string; the cut is where searching the whole text would have put it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"   # what a UTF-8 decoder makes of an incomplete (or invalid) byte sequence
MAX_UTF8_CONTINUATION = 3  # bytes that can follow a character's first byte


class IncrementalDetokenizer:
    """Output token ids in, new text out; `ids` holds every id pushed so far."""

    def __init__(self, decode: Callable[[list[int]], str], max_pending: int = 8) -> None:
        self._decode = decode
        self.max_pending = max_pending
        self.ids: list[int] = []
        self.prefix_offset = 0   # the window starts here: tokens already emitted, decoded again for context
        self.read_offset = 0     # tokens before this have been emitted
        self._prefix_text = ""   # decode(ids[prefix_offset:read_offset])

    @property
    def num_pending(self) -> int:
        """Tokens pushed whose text has not been emitted yet."""
        return len(self.ids) - self.read_offset

    def push(self, new_ids: Iterable[int]) -> str:
        """The text that these ids complete ("" while a character is still incomplete)."""
        self.ids.extend(new_ids)
        if not self.num_pending:
            return ""
        text = self._decode(self.ids[self.prefix_offset:])
        if not text.endswith(REPLACEMENT):
            return self._advance(len(self.ids), text)
        if self.num_pending > self.max_pending:  # a long run that never completes: cut it where it is safe
            return self._cut_safely(text)
        return ""

    def finish(self) -> str:
        """What is still held back, as it decodes now (an incomplete character becomes U+FFFD)."""
        if not self.num_pending:
            return ""
        return self._advance(len(self.ids), self._decode(self.ids[self.prefix_offset:]))

    def _advance(self, end: int, text: str) -> str:
        """Emit the window's text past the prefix, up to token `end`; that piece becomes the next prefix."""
        piece = text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return piece

    def _cut_safely(self, text: str) -> str:
        """Emit up to the latest token boundary the text can be split at without changing it.

        A split is safe when the two halves decode to the whole: a character cut in two would decode
        as replacement characters on both sides instead. With at least MAX_UTF8_CONTINUATION
        characters (so as many bytes) after the split, the bytes that could complete a character
        begun before it are all there already, so later tokens cannot make the split wrong."""
        for end in range(len(self.ids) - 1, self.read_offset, -1):
            right = self._decode(self.ids[end:])
            if len(right) < MAX_UTF8_CONTINUATION:
                continue
            left = self._decode(self.ids[self.prefix_offset:end])
            if left + right == text and len(left) >= len(self._prefix_text):
                return self._advance(end, left)
        return ""  # no safe boundary yet (e.g. a run of skipped special tokens): keep holding


class StopStrings:
    """Cut text pieces at the first stop string; `is_stopped` once one was found."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars that may begin a stop string
        self._tail = ""          # held back: seen, not yet emitted
        self.is_stopped = False

    def feed(self, text: str) -> str:
        """The part of the text seen so far that is final: up to a stop string, or all but the held tail."""
        if self.is_stopped:
            return ""
        # a new stop string can only start in the held tail (at most `hold` chars back) or in the new text
        window = self._tail + text
        cut = min((i for i in (window.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.is_stopped, self._tail = True, ""
            return window[:cut]
        keep = max(len(window) - self.hold, 0)
        self._tail = window[keep:]
        return window[:keep]

    def finish(self) -> str:
        """The held tail, at the end of the text (it began no stop string)."""
        tail, self._tail = self._tail, ""
        return "" if self.is_stopped else tail
