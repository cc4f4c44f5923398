"""Ending the MQTT session of a learner that will not run again (`learner/takeover.py` calls it).

Contract: `retire_session` resumes the session (the same client id and protocol as
`mqtt.subscribe_forever` used for it), takes what the broker still queued for it through
`handle` (each message acknowledged only after `handle` returned), unsubscribes it so nothing more
is queued for it, takes what reached it before the broker took the unsubscription, and ends the
session with a clean start, so the broker keeps nothing for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from specd.transport.mqtt import MqttSettings


async def retire_session(settings: MqttSettings, client_id: str, share_group: str | None,
                         handle: Callable[[str, bytes], Awaitable[None]], quiet_s: float = 2.0) -> int:
    """End the persistent session of a learner that will not run again (`learner/takeover.py`):
    resume it, take what the broker still queued for it through `handle` (acknowledged after, as
    `subscribe_forever` does) until `quiet_s` pass without a message, unsubscribe it so nothing more
    is queued for it, and end it. Returns how many messages it took."""
    records, reports = settings.topic("records") + "/+", settings.topic("reports") + "/+"
    client = settings.client(identifier=client_id, clean_session=False, persistent_v5=share_group is not None)
    client._client.manual_ack_set(True)
    taken = 0

    async def take_until_quiet() -> None:
        nonlocal taken
        messages = aiter(client.messages)
        while True:
            try:
                async with asyncio.timeout(quiet_s):
                    message = await anext(messages)
            except TimeoutError:
                return
            await handle(str(message.topic), bytes(message.payload))
            client._client.ack(message.mid, message.qos)
            taken += 1

    async with client:
        await take_until_quiet()
        await client.unsubscribe([records if share_group is None else f"$share/{share_group}/{records}", reports])
        await take_until_quiet()  # what reached the session before the broker took the unsubscription
    # a clean start discards the session; with no expiry (v5) or clean_session (3.1.1) none is kept after
    async with settings.client(identifier=client_id, clean_session=True, end_v5=share_group is not None):
        pass
    return taken
