"""Free TCP ports for servers and rank rendezvous.

    free_ports(n, host) -> n distinct ports nobody listens on now
    free_port(host)     -> one

The n sockets stay bound until every port is picked: separate one-port picks can return the same port twice
(tritonserver then refuses its HTTP and metrics ports, `make test`, 2026-12-07). Another process can still take
a port between the pick and its use: a server started on it then fails with the server's own message."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
