"""The soak's clients: mixed chat and code traffic over HTTP, each outcome tallied by kind.

Contract: `Tally` collects one `Outcome` per request (kind, server, HTTP status or the error,
whether it fell inside the flood window, whether a greedy answer equalled the target's alone).
`client_loop` sends requests to the servers in turn until its deadline: greedy chat (plain and
streamed), greedy code completions, sampled requests with OpenAI's default temperature (1.0,
plain and streamed), clients that disconnect early (streaming: after the first chunks; not
streaming: a short client timeout), and malformed requests that must be answered 4xx.
`flood` keeps many requests in flight against one server for a while, past its queue bound.
Greedy prompts come with their target-only answers; sampled ones cannot be checked.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

KINDS = {"greedy_chat": 0.22, "greedy_chat_stream": 0.18, "greedy_code": 0.15, "sampled": 0.10,
         "sampled_stream": 0.10, "disconnect_stream": 0.08, "disconnect": 0.07, "malformed": 0.10}
# each malformed body must be answered 4xx: JSON that is not an object, a wrong type, a range the
# engine cannot take, a missing field, a refused feature
MALFORMED: list[bytes | dict[str, Any]] = [
    b"{not json", b"[1, 2, 3]",
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 80},
    {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"max_tokens": 4},
]


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool                   # chat completion (template) or plain completion (code)
    domain: str
    expected: str | None = None  # the target's own greedy answer, for greedy requests


@dataclass
class Outcome:
    kind: str
    server: int
    at: float
    status: int | None           # None: no answer (connection error, timeout, deliberate disconnect)
    error: str | None = None
    in_flood: bool = False       # sent between the flood's start and the drain of its queue (set by summary)
    greedy_equal: bool | None = None


@dataclass
class Tally:
    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    flood_window: tuple[float, float] | None = None
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started

    def progress(self) -> str:
        """So far: requests sent, answered 200, refused 429, and answered 5xx or not at all (a client's
        own early disconnects aside); the flood's 429s are judged at the end."""
        answered = [o.status for o in self.outcomes]
        lost = sum(1 for o in self.outcomes if o.status is None and o.error != "disconnected")
        return (f"{len(answered)} requests: {answered.count(200)} answered 200, {answered.count(429)} refused 429, "
                f"{sum(1 for status in answered if status is not None and status >= 500) + lost} 5xx or unanswered")

    def add(self, kind: str, server: int, at: float, status: int | None, error: str | None = None,
            greedy_equal: bool | None = None) -> None:
        self.outcomes.append(Outcome(kind, server, at, status, error, False, greedy_equal))

    def failed(self, outcome: Outcome) -> bool:
        """A request the service let down: a 5xx, no answer where one was due, a malformed request
        accepted, a 429 outside the flood, a greedy answer that differs from the target's."""
        if outcome.kind.startswith("disconnect") and outcome.status is None and outcome.error == "disconnected":
            return False
        if outcome.status == 429:  # the queue bound answers before anything else, malformed requests too
            return not outcome.in_flood
        if outcome.kind == "malformed":
            return outcome.status is None or not 400 <= outcome.status < 500
        return outcome.status != 200 or outcome.greedy_equal is False

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {"sent": len(self.outcomes), "succeeded": 0, "refused_429_flood": 0,
                                  "refused_429_outside_flood": 0, "malformed_answered_4xx": 0,
                                  "disconnected_early": 0, "failed": 0, "greedy_checked": 0, "greedy_equal": 0}
        failures: dict[str, int] = {}
        failed_at: list[dict[str, Any]] = []
        window = self.flood_window  # final now: from the flood's start until its queue drained
        for outcome in self.outcomes:
            outcome.in_flood = window is not None and window[0] <= outcome.at <= window[1]
            if outcome.greedy_equal is not None:
                counts["greedy_checked"] += 1
                counts["greedy_equal"] += int(outcome.greedy_equal)
            # each request in one class (succeeded, 429 in the flood, malformed 4xx, disconnected,
            # failed): they add up to `sent`; a 429 outside the flood is a failure, also counted apart
            if self.failed(outcome):
                counts["failed"] += 1
                counts["refused_429_outside_flood"] += int(outcome.status == 429)
                label = f"{outcome.kind}: {outcome.status or outcome.error}"
                failures[label] = failures.get(label, 0) + 1
                failed_at.append({"kind": outcome.kind, "server": outcome.server + 1, "at": round(outcome.at, 1),
                                  "status": outcome.status, "error": outcome.error})
            elif outcome.status == 429:
                counts["refused_429_flood"] += 1
            elif outcome.kind == "malformed":
                counts["malformed_answered_4xx"] += 1
            elif outcome.status is None:
                counts["disconnected_early"] += 1
            elif outcome.status == 200:
                counts["succeeded"] += 1
        return {**counts, "failures": failures, "failed_requests": failed_at[:50], "flood_window": self.flood_window,
                "mismatches": self.mismatches[:10]}


def _body(prompt: Prompt, max_tokens: int, greedy: bool, stream: bool, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "soak", "max_tokens": max_tokens, "stream": stream,
                            "metadata": {"domain": prompt.domain}}
    if prompt.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if greedy:
        body["temperature"] = 0
    else:
        body["seed"] = seed  # temperature left out: OpenAI's default, 1.0
    return body


async def _read_stream(response: aiohttp.ClientResponse, chat: bool, stop_after: int | None) -> tuple[str, bool]:
    """The streamed text, and whether the stream ended with [DONE] after no error event."""
    text: list[str] = []
    clean = False
    chunks = 0
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return "".join(text), clean or not text
        payload = json.loads(data)
        if "error" in payload:
            return "".join(text), False
        for choice in payload.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            text.append(piece or "")
        clean = True
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            raise ConnectionAbortedError("disconnected")
    return "".join(text), False


async def one_request(session: aiohttp.ClientSession, url: str, kind: str, prompt: Prompt, max_tokens: int,
                      rng: random.Random) -> tuple[int | None, str | None, bool | None]:
    """Send one request of `kind`; (status, error, greedy answer equal to the target's)."""
    if kind == "malformed":
        bad = rng.choice(MALFORMED)
        data = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        async with session.post(url + "/v1/chat/completions", data=data,
                                headers={"Content-Type": "application/json"}) as response:
            await response.read()
            return response.status, None, None
    greedy = kind.startswith("greedy")
    stream = kind.endswith("stream")
    route = "/v1/chat/completions" if prompt.chat else "/v1/completions"
    body = _body(prompt, max_tokens, greedy, stream, rng.randrange(2 ** 31))
    timeout = aiohttp.ClientTimeout(total=0.5 if kind == "disconnect" else 300)
    try:
        async with session.post(url + route, json=body, timeout=timeout) as response:
            if response.status != 200:
                await response.read()
                return response.status, None, None
            if stream:
                text, clean = await _read_stream(response, prompt.chat, 2 if kind == "disconnect_stream" else None)
                if not clean:
                    return 200, "stream ended with an error event or without [DONE]", None
            else:
                answer = await response.json()
                choice = answer["choices"][0]
                text = choice["message"]["content"] if prompt.chat else choice["text"]
    except (TimeoutError, ConnectionAbortedError) as error:
        if kind.startswith("disconnect"):
            return None, "disconnected", None
        return None, f"{type(error).__name__}: {error}", None
    return 200, None, (text == prompt.expected) if greedy else None


async def client_loop(client: int, urls: list[str], greedy: list[Prompt], sampled: list[Prompt], max_tokens: int,
                      deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed * 1000 + client)
    kinds, weights = zip(*KINDS.items(), strict=True)
    async with aiohttp.ClientSession() as session:
        turn = client
        while tally.now() < deadline:
            kind = rng.choices(kinds, weights)[0]
            if kind == "greedy_code":
                prompt = rng.choice([p for p in greedy if not p.chat])
            elif kind.startswith("greedy"):
                prompt = rng.choice([p for p in greedy if p.chat])
            else:
                prompt = rng.choice(sampled)
            server = turn % len(urls)
            turn += 1
            at = tally.now()
            try:
                status, error, equal = await one_request(session, urls[server], kind, prompt, max_tokens, rng)
            except (aiohttp.ClientError, OSError, ValueError, KeyError) as failure:
                status, error, equal = None, f"{type(failure).__name__}: {failure}", None
            if equal is False:
                tally.mismatches.append({"kind": kind, "prompt": prompt.text[:80], "server": server})
            tally.add(kind, server, at, status, error, equal)
            if status == 429:
                await asyncio.sleep(0.5)  # as a polite client does after Retry-After


async def flood(url: str, server: int, prompts: list[Prompt], max_tokens: int, seconds: float, width: int,
                tally: Tally) -> None:
    """`width` requests kept in flight against one server for `seconds`: past its queue bound."""
    end = tally.now() + seconds
    rng = random.Random(7)

    async def hammer(session: aiohttp.ClientSession) -> None:
        while tally.now() < end:
            at = tally.now()
            try:
                status, error, _ = await one_request(session, url, "sampled", rng.choice(prompts), max_tokens, rng)
            except (aiohttp.ClientError, OSError, ValueError, KeyError) as failure:
                status, error = None, f"{type(failure).__name__}: {failure}"
            tally.add("flood", server, at, status, error)
            if status == 429:
                await asyncio.sleep(0.05)  # abusive, but leaving the server's cores some room to decode

    connector = aiohttp.TCPConnector(limit=width)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(hammer(session) for _ in range(width)))
