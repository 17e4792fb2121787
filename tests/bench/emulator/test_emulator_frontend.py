"""The emulated API server (processor sharing, emulated instants) and the fit of its
share: CPU per request and chunk, speed while the engine steps."""

from __future__ import annotations

import asyncio

import pytest

from bench.emulator.fit import (
    FrontendSample,
    Probe,
    burst_ttft,
    busy_ttft,
    frontend_costs,
    speed_while_stepping,
)
from bench.emulator.frontend import Frontend
from bench.emulator.measure import Load
from bench.emulator.profile import Profile, StepModel


def profile(**changes: object) -> Profile:
    fields: dict[str, object] = {
        "name": "t", "model": "m", "step": StepModel(base_s=0.002, per_token_s=1e-5,
                                                     per_seq_s=1e-4),
        "max_num_seqs": 64, "max_num_batched_tokens": 8192, "kv_blocks": 1024,
        "block_size": 16, "max_model_len": 1024}
    return Profile.model_validate(fields | changes)


async def test_simultaneous_work_finishes_together_at_emulated_instants() -> None:
    frontend = Frontend()
    start = asyncio.get_running_loop().time()
    done = await asyncio.gather(*(frontend.run(0.01, start) for _ in range(3)))
    assert done == pytest.approx([start + 0.03] * 3, abs=1e-6)  # not 0.01, 0.02, 0.03
    assert frontend.active == 0


async def test_later_work_shares_what_is_left() -> None:
    frontend = Frontend()
    now = asyncio.get_running_loop().time()
    first = asyncio.create_task(frontend.run(0.02, now - 0.01))  # 10 ms done by now
    await asyncio.sleep(0)
    # now a second piece of 5 ms: both at half speed until it is done
    second = await frontend.run(0.005, now)
    assert second == pytest.approx(now + 0.01, abs=1e-6)
    assert await first == pytest.approx(now + 0.015, abs=1e-6)


async def test_a_stepping_engine_slows_the_api_server() -> None:
    frontend = Frontend(speed_while_stepping=0.5)
    start = asyncio.get_running_loop().time()
    work = asyncio.create_task(frontend.run(0.02, start))
    await asyncio.sleep(0)
    frontend.engine_busy(True, start + 0.01)  # 10 ms done, 10 ms left at half speed
    assert await work == pytest.approx(start + 0.03, abs=1e-6)


async def test_cancelled_work_leaves_the_cpu_to_the_rest() -> None:
    frontend = Frontend()
    start = asyncio.get_running_loop().time()
    gone = asyncio.create_task(frontend.run(10.0, start))
    kept = asyncio.create_task(frontend.run(0.005, start))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await kept < start + 0.05 and frontend.active == 0


def test_frontend_costs_recover_cpu_per_request_and_chunk() -> None:
    truth = (0.0012, 4e-5, 0.01)  # per request, per chunk, idle per wall second
    shapes = [(1, 2, 0.01), (16, 32, 0.05), (8, 760, 0.4), (24, 2280, 0.6), (14, 1612, 0.7)]
    samples = [FrontendSample(r, c, w, truth[0] * r + truth[1] * c + truth[2] * w)
               for r, c, w in [(0, 0, 0.3), *shapes]]  # an idle sample, then probes
    assert frontend_costs(samples) == pytest.approx(truth[:2], rel=1e-6)


def test_a_burst_reaches_the_engine_together() -> None:
    zero_cost = profile(step=StepModel(base_s=0.004, per_token_s=0.0),
                        request_overhead_s=0.001, request_latency_s=0.002,
                        chunk_overhead_s=1e-4)
    # 8 x 1 ms shared, 2 ms latency, one 4 ms step, 8 first chunks shared
    assert burst_ttft(zero_cost, 8, 256) == pytest.approx(0.008 + 0.002 + 0.004 + 8e-4)


def test_the_busy_probes_give_back_the_speed_they_were_made_with() -> None:
    made = profile(request_overhead_s=0.001, request_latency_s=0.002, chunk_overhead_s=5e-5,
                   frontend_speed_while_stepping=0.6)
    busy = [(Probe("busy", Load(1, 6, 256, 2), streams), busy_ttft(made, 256, streams))
            for streams in (4, 8, 16)]
    full_speed = made.model_copy(update={"frontend_speed_while_stepping": 1.0})
    assert all(busy_ttft(full_speed, 256, p.background) < value for p, value in busy)
    assert speed_while_stepping(full_speed, busy) == pytest.approx(0.6, abs=1e-9)
