"""Free loopback ports for launching several services at once."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now. All are held open until every one is chosen: asking one
    at a time can return the same port twice (it is free again once released), and two services
    started together would then collide."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
