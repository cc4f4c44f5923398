"""Whether this process could listen on an address, found out before anything slow starts.

Contract: `check_address(host, port)` binds each of the address's sockets once and lets them go;
an address taken, not this machine's, privileged, or a host that does not resolve raises
`ConfigurationError` naming it in one line (`cannot_listen`), never a traceback. `specd serve`,
`specd learner` and `specd vllm` call it before loading a model (a server started later may still
lose the address in between; each catches that too).
"""

from __future__ import annotations

import os
import socket

from specd.core.errors import ConfigurationError


def check_address(host: str, port: int) -> None:
    """Bind `host:port` once and let it go, so that a taken or foreign address is found out before a
    model and a learner start (`listen` still catches the rare case of losing it in between)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
                probe.bind(address)
    except OSError as error:  # socket.gaierror (a host that does not resolve) among them
        raise cannot_listen(host, port, error) from None


def cannot_listen(host: str, port: int, error: OSError) -> ConfigurationError:
    """The one-line error for an address that cannot be bound."""
    # the errno's own words ("Address already in use"); a resolver error (negative code) has only its text
    reason = os.strerror(error.errno) if error.errno and error.errno > 0 else error.strerror or str(error)
    return ConfigurationError(f"cannot listen on {host}:{port}: {reason}")
