"""The reader's clock, the buffer target (Eq. 6) and the migration rule (Eq. 4-5)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.disco.cost import TokenCost
from policies.disco.playback import (
    PlaybackClock,
    buffer_target,
    consumption_times,
    should_migrate,
    stalls,
)


def test_tokens_faster_than_the_reader_never_stall() -> None:
    arrivals = np.asarray(np.arange(40) * 0.05, dtype=np.float64)  # 20 tokens/s, read at 5
    seen = stalls(arrivals, 5.0)
    assert seen.delayed_tokens == 0 and seen.stall_s == 0.0
    assert seen.gaps == pytest.approx(np.full(39, 0.2))
    clock = PlaybackClock(5.0)
    for at in arrivals:
        clock.arrive(float(at))
    assert clock.delayed_tokens == 0
    assert clock.buffered(0.9) == 19 - 5  # 19 arrived by 0.9 s, read at 0, .2, .4, .6, .8


def test_a_late_token_is_counted_with_its_stall() -> None:
    arrivals = np.array([0.0, 0.1, 0.2, 1.5, 1.6])
    assert consumption_times(arrivals, 5.0) == pytest.approx([0.0, 0.2, 0.4, 1.5, 1.7])
    seen = stalls(arrivals, 5.0)
    assert seen.delayed_tokens == 1 and seen.stall_s == pytest.approx(0.9)
    clock = PlaybackClock(5.0)
    for at in arrivals:
        clock.arrive(float(at))
    assert clock.delayed_tokens == 1 and clock.stall_s == pytest.approx(0.9)
    assert clock.buffered(1.5) == 0 and clock.buffered(1.6) == 1


def test_a_machine_reader_takes_tokens_as_they_come() -> None:
    arrivals = np.array([0.0, 3.0, 3.1])
    seen = stalls(arrivals, 0.0)
    assert seen.delayed_tokens == 0 and seen.gaps == pytest.approx([3.0, 0.1])
    assert buffer_target(0.0, 2.0) == 0.0
    assert buffer_target(5.0, 0.8) == pytest.approx(4.0)


def test_migration_pays_only_past_the_re_prefill() -> None:
    device = TokenCost(prefill=0.8, decode=2.0)
    server = TokenCost(prefill=0.15, decode=0.6)
    # saving 1.4 per remaining token against 0.15 · 100 context tokens = 15
    assert not should_migrate(device, server, remaining_tokens=10, context_tokens=100)
    assert should_migrate(device, server, remaining_tokens=11, context_tokens=100)
    assert not should_migrate(server, device, remaining_tokens=10**6, context_tokens=1)
    assert not should_migrate(device, server, remaining_tokens=-5, context_tokens=0)
