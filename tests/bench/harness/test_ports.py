"""Ports for test and bench servers stay out of the kernel's ephemeral range."""

from __future__ import annotations

import socket

from bench.harness.ports import SINGLE_PORTS, bindable, free_port, free_port_range


def test_free_port_is_below_the_ephemeral_range_and_never_repeats() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in SINGLE_PORTS and p < 32768 for p in ports)
    assert all(bindable(p) for p in ports[:20])


def test_free_port_skips_a_port_in_use() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        assert not bindable(port)


def test_free_port_range_steps_over_a_taken_port() -> None:
    base = free_port_range(4, start=21000)
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 2))
        held.listen()
        moved = free_port_range(4, start=base)
    assert moved == base + 3
    assert all(bindable(p) for p in range(moved, moved + 4))


def test_free_port_ranges_start_anywhere_below_the_ephemeral_range() -> None:
    bases = {free_port_range(8) for _ in range(20)}
    assert len(bases) > 1  # two processes asking at once rarely get the same
    assert all(20000 <= b and b + 8 <= 32768 for b in bases)
