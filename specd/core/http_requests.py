"""What every specd HTTP route that takes a body or a token reads from a request (the OpenAI API
and the control plane alike), so that both refuse bad input the same way; the learner reads its
MQTT messages with `json_object` too.

Contract: `json_object(raw)` is the body as a dict, or `BadRequest` saying why (not UTF-8, not
JSON, nested too deeply, not an object), never another exception whatever the bytes.
`read_body(request)` awaits the body for at most `BODY_TIMEOUT_S` (`BodyIncomplete`, a 408, after:
a client that stops sending mid-body must not hold a connection forever) and turns a client that
hung up mid-body into `BodyIncomplete` too (the answer goes nowhere, and nothing logs a traceback).
`json_object_off_loop(raw)` is `json_object`, parsed on a thread when the body is over `INLINE_JSON_BYTES`.
`bearer_matches(header, secret)` compares in constant time, the scheme name in any case (RFC 7235).
Imports nothing of aiohttp: a request is anything with an awaitable `read()`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from specd.core.errors import BadRequest

BODY_TIMEOUT_S = 30.0
INLINE_JSON_BYTES = 64 * 1024   # bodies up to this are parsed on the loop: a thread hop would cost more


class BodyIncomplete(BadRequest):
    """The request's body did not arrive whole: too slow, or the client hung up."""

    http_status = 408


def json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except RecursionError:  # e.g. a hundred thousand nested '['
        raise BadRequest("the request body is nested too deeply to parse") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer literal past Python's digit limit
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def read_body(request: Any, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    try:
        return bytes(await asyncio.wait_for(request.read(), timeout_s))
    except TimeoutError:
        raise BodyIncomplete(f"the request body did not arrive within {timeout_s:.0f} s") from None
    except ConnectionResetError:
        raise BodyIncomplete("the client closed the connection before its request body was complete") from None


async def json_object_off_loop(raw: bytes) -> dict[str, Any]:
    """`json_object`, on a thread when the body is large: parsing megabytes on the event loop would
    stall every other request it serves (streams included)."""
    if len(raw) <= INLINE_JSON_BYTES:
        return json_object(raw)
    return await asyncio.to_thread(json_object, raw)


def bearer_matches(header: str, secret: str) -> bool:
    """`Authorization: Bearer <secret>`; constant time, so how long a wrong secret takes to refuse
    says nothing about the right one."""
    scheme, _, given = header.partition(" ")
    return hmac.compare_digest(f"{scheme.lower()} {given}".encode(), f"bearer {secret}".encode())
