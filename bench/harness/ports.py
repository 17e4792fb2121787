"""Free local ports for the servers that tests and benchmarks start.

Ports come from below Linux's ephemeral range (32768-60999): a port the kernel
handed out for `bind(0)` is free only until the next outgoing connection, and a vLLM
server opens many (its engine sockets). Between our pick and the server's bind, one of
those could take it (seen in CI: the ELDR plugin's side server got EADDRINUSE).
Single ports come from 10000-19999, ranges from 20000 up, so the two never meet.
"""

from __future__ import annotations

import random
import socket

SINGLE_PORTS = range(10000, 20000)
RANGE_PORTS = range(20000, 32768)
_given: set[int] = set()  # this process's picks, not bound yet by their server maybe


def free_port() -> int:
    """A free port, never the same twice in one process."""
    while True:
        port = random.choice(SINGLE_PORTS)
        if port not in _given and bindable(port):
            _given.add(port)
            return port


def free_port_range(count: int, start: int | None = None) -> int:
    """A base port with `count` free ports above it, below the ephemeral range: from
    `start` up, or by default from a random port of 20000-32767, so that processes
    picking at once (the suite's workers) rarely step on each other."""
    base = start if start is not None else random.randrange(RANGE_PORTS.start,
                                                            RANGE_PORTS.stop - 4 * count)
    while True:
        taken = next((p for p in range(base, base + count) if not bindable(p)), None)
        if taken is None:
            return base
        base = taken + 1


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
