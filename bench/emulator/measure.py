"""Streamed latency under load: the same load against a real vLLM or the emulator.

`concurrency` workers each send streaming `/v1/completions` requests back to back,
prompts given as token ids (exact lengths, every prompt distinct so no prefix-cache
hits; seeds fresh per run), `ignore_eos` so every answer has exactly `output_tokens`
tokens. TTFT is the time to the first token; TPOT is (last token - first token) /
(tokens - 1), with the token count taken from `usage`, since vLLM may pack several
tokens into one chunk. Waves (`run_waves`) send `concurrency` requests at once and
wait for all of them: the fit's probes. A decode probe counts TPOT only after the
wave's last first token (`decode_only`): a wave whose prompts exceed one step's token
budget prefills in chunks, and until then the others' steps carry prefill work.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import orjson

PROMPT_ID_RANGE = (10, 4000)  # inside the tiny models' vocabulary, past the specials
BUSY_BACKGROUND_TOKENS = 200  # background streams of `run_busy_arrivals`: 0.3-1 s here
BUSY_START_S = 0.05  # ... given this long to be prefilled and decoding


@dataclass(frozen=True, slots=True)
class Load:
    concurrency: int
    requests: int  # in all, spread over the workers
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_s: float
    tpot_s: float
    tokens: int
    events: tuple[float, ...] = ()  # perf_counter() of each streamed chunk with a choice


@dataclass(frozen=True, slots=True)
class Summary:
    ttft_s: float  # trimmed means over the requests (see `summarize`)
    tpot_s: float
    requests: int


def run_seed() -> int:
    """A fresh seed per run: a real server keeps prompts in its prefix cache across
    runs, so a prompt seen by an earlier run would be prefilled for free."""
    return random.SystemRandom().randrange(1 << 40)


def prompts(load: Load, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*PROMPT_ID_RANGE) for _ in range(load.prompt_tokens)]
            for _ in range(load.requests)]


async def stream_one(session: aiohttp.ClientSession, url: str, model: str,
                     prompt_ids: list[int], max_tokens: int) -> Timing:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    events: list[float] = []
    tokens = 0
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                events.append(time.perf_counter())
    if tokens < 2 or not events:
        raise RuntimeError(f"{url}: expected a streamed answer of several tokens")
    return Timing(events[0] - started, (events[-1] - events[0]) / (tokens - 1), tokens,
                  tuple(events))


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def run_load(url: str, model: str, load: Load, seed: int = 0) -> list[Timing]:
    """Closed loop: each worker sends its next request when the last one ends."""
    queue = prompts(load, seed)
    timings: list[Timing] = []
    async with _session() as session:

        async def worker() -> None:
            while queue:
                prompt_ids = queue.pop()
                timings.append(await stream_one(session, url, model, prompt_ids,
                                                load.output_tokens))

        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    return timings


def summarize(timings: Sequence[Timing], skip: int = 0) -> Summary:
    """Means without the highest and lowest 10%, leaving out the first `skip` requests
    (warm-up). Not medians: under closed-loop load the latencies are bimodal (requests
    prefilled in the first or the second chunk of a batch), and a median jumps from
    one mode to the other on a small shift; the trimmed mean moves smoothly and still
    ignores stalls caused by other processes on the machine."""
    kept = list(timings[skip:]) or list(timings)
    return Summary(trimmed_mean([t.ttft_s for t in kept]),
                   trimmed_mean([t.tpot_s for t in kept]), len(kept))


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    ordered = sorted(values)
    drop = int(len(ordered) * cut)
    return statistics.fmean(ordered[drop:len(ordered) - drop])


async def run_waves(url: str, model: str, load: Load, seed: int = 0,
                    decode_only: bool = False) -> list[Timing]:
    """Waves of `concurrency` simultaneous requests, each wave after the last ends;
    `decode_only`: TPOT counted after each wave's last first token."""
    queue = prompts(load, seed)
    timings: list[Timing] = []
    async with _session() as session:
        await warm_connections(session, url, load.concurrency)
        for start in range(0, len(queue), load.concurrency):
            wave = await asyncio.gather(*(
                stream_one(session, url, model, prompt_ids, load.output_tokens)
                for prompt_ids in queue[start:start + load.concurrency]))
            timings += after_prefills(wave) if decode_only else wave
    return timings


async def warm_connections(session: aiohttp.ClientSession, url: str, count: int) -> None:
    """Open `count` keep-alive connections first: a request on a fresh connection pays
    the TCP and HTTP set-up, which a closed-loop client (and the emulator floor) does
    not; counted in a one-request probe, it went into the fitted request overhead."""

    async def touch() -> None:
        async with session.get(f"{url}/v1/models") as response:
            await response.read()

    await asyncio.gather(*(touch() for _ in range(count)))


async def run_busy_arrivals(url: str, model: str, background: int, load: Load, seed: int = 0
                            ) -> tuple[list[Timing], list[Timing]]:
    """`load.requests` requests one after another, each sent while `background`
    streams of 16-token prompts decode (they start first and outlast the probes): the
    API server then shares the CPU with the engine. (The probes' timings, the
    background's.)"""
    queue = prompts(load, seed)
    streams = prompts(Load(background, background, 16, 0), seed + 1)
    tokens = BUSY_BACKGROUND_TOKENS
    async with _session() as session:
        await warm_connections(session, url, background + 1)
        running = [asyncio.create_task(stream_one(session, url, model, ids, tokens))
                   for ids in streams]
        await asyncio.sleep(BUSY_START_S)  # the background is decoding by then
        timings = [await stream_one(session, url, model, ids, load.output_tokens)
                   for ids in queue]
        return timings, list(await asyncio.gather(*running))


def after_prefills(wave: Sequence[Timing]) -> list[Timing]:
    """The wave's timings with TPOT over the chunks after its last first token (one
    token per chunk; a request whose chunks carried several keeps its overall TPOT)."""
    start = max(t.events[0] for t in wave)
    out = []
    for timing in wave:
        after = [e for e in timing.events if e >= start]
        if len(timing.events) != timing.tokens or len(after) < 3:
            out.append(timing)
        else:
            out.append(replace(timing, tpot_s=(after[-1] - after[0]) / (len(after) - 1)))
    return out


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu_s(pid: int) -> float:
    """CPU seconds all threads of process `pid` ran so far (ns precision, from
    schedstat; /proc/pid/stat counts 10 ms ticks, too coarse for one probe)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def over_passes(values: Sequence[float]) -> float:
    """Mean of one figure over repeated passes without the highest and the lowest (from
    5 passes on). A mean, not a median: the machine's speed drifts between two or three
    levels as other work comes and goes, and the fit's rounds and the check's passes,
    taken in turn, see the same mixture; a median of a few passes picks a level."""
    ordered = sorted(values)
    drop = 1 if len(ordered) >= 5 else 0
    return statistics.fmean(ordered[drop:len(ordered) - drop])
