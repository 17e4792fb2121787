"""`make bench STUDY=memory`: the proxy's memory, beside a bare relay measured in the same run.

The figure is each process's anonymous resident memory (`RssAnon` in /proc: its heap,
what a leak grows; shared libraries left out), read while the load runs.

* Idle: after a warm-up of every kind of request below.
* Growth: waves of mixed requests (streamed and whole chat completions, streamed
  completions, forced migrations between two backends, clients that leave mid-stream,
  malformed bodies, unknown models), memory after each wave; the growth per 1000
  requests after the warm-up waves (a least-squares slope). The floor relay gets the
  same number of plain streams. Every answer is checked: a wrong status, or a stream
  cut short, is counted as a failure. RssAnon moves in steps of the allocator's arenas
  (a few hundred KB), so the same waves run again through laneway in this process,
  measured by tracemalloc: the Python objects the requests leave behind.
* Per open stream: C concurrent streams held open; (memory with all C open - memory
  before) / C. At a pace the proxy keeps up with (`held`: 256 and 1024 streams at
  200 ms/token), and at one it does not (1024 at 20 ms/token: 51k tokens/s asked of one
  process, whose unread upstream bytes then wait in its buffers). laneway tracks each
  stream for migration (the default: every event decoded, the generation kept); the
  floor is the bare uvicorn + aiohttp relay of `bench.studies.overhead` in front of the same
  kind of fake.

Targets (`TARGETS`): at most 100 KB per open stream at a pace the proxy keeps up with
(10 000 concurrent streams in 1 GB), and at most 10 KB of traced growth per 1000
requests after the warm-up (a leak of 10 bytes a request or more fails it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import signal
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.proxy_process import running_proxy
from bench.harness.report import git_commit
from bench.harness.results import publish
from bench.studies.overhead_load import chat_body
from bench.studies.overhead_procs import fake_process, minimal_relay, wait_ok
from predictors.home import REPO
from proxy.config import Settings
from proxy.http.server import serve_in_loop

TARGETS = {"kb_per_open_stream": 100.0, "growth_kb_per_1k_requests": 10.0}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_WORDS = ("route", "token", "cache", "prefix", "stream", "backend", "latency", "model",
          "queue", "batch", "expert", "prompt")


@dataclass(frozen=True, slots=True)
class Plan:
    # (model, streams open at once): one measure each. `held` streams come at a rate the
    # proxy keeps up with (1024 x 5 tokens/s); 1024 `paced` ones ask 51k tokens/s, more
    # than one proxy process relays here: their bytes wait in the proxy's buffers.
    held: tuple[tuple[str, int], ...] = (("held", 256), ("held", 1024), ("paced", 1024))
    hold_s: float = 10.0  # each held stream's length, in its fake's time
    held_tpot_ms: float = 200.0  # the `held` fake's pacing
    tpot_ms: float = 20.0  # the `paced` fakes' pacing (migrations, leaving clients)
    waves: int = 12
    wave_requests: int = 3000
    warmup_waves: int = 3  # left out of the growth slope
    concurrency: int = 64  # requests in flight during a wave
    seed: int = 0
    timeout_s: float = 120.0  # per request
    # forced moves by the frozen handoff (no warm-up racing the source, no paced
    # catch-up): every one completes however busy the machine, as a test needs; the
    # benchmark keeps laneway's defaults
    frozen_moves: bool = False


DEFAULT = Plan()
QUICK = Plan(held=(("held", 64),), hold_s=2.0, held_tpot_ms=50.0, waves=4,
             wave_requests=300, warmup_waves=1)


def held_tokens(plan: Plan, model: str) -> int:
    """Tokens of a held stream on `model`: `hold_s` at its fake's pacing."""
    return max(2, round(plan.hold_s * 1000 / (plan.held_tpot_ms if model == "held"
                                              else plan.tpot_ms)))


def rss_kb(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of a process, in KB (kB in /proc/<pid>/status)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0])
    return fields


def slope_per_1k(requests: list[int], kb: list[int]) -> float:
    """Least-squares KB per 1000 requests of memory `kb` after `requests` requests."""
    n = len(requests)
    if n < 2:
        return 0.0
    mx, my = sum(requests) / n, sum(kb) / n
    var = sum((x - mx) ** 2 for x in requests)
    cov = sum((x - mx) * (y - my) for x, y in zip(requests, kb, strict=True))
    return cov / var * 1000 if var else 0.0


# -- the load -----------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 40)))


def client() -> aiohttp.ClientSession:
    """A load generator's client: no cap on its connections."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def _stream(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
                  headers: dict[str, str] | None = None, leave_after: int | None = None,
                  on_first: Callable[[], None] | None = None) -> str | None:
    """None if the stream came whole (ends with [DONE]), or after `leave_after` events
    (the client leaves); else what went wrong. `on_first`: called at its first chunk."""
    tail, events = b"", 0
    async with http.post(url + path, json=body, headers=headers) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.text())[:300]}"
        async for chunk in resp.content.iter_any():
            if on_first is not None and not tail:
                on_first()
            events += chunk.count(b"data: ")
            tail = (tail + chunk)[-64:]
            if leave_after is not None and events >= leave_after:
                return None  # leaving: the context manager closes the connection
    return None if tail.rstrip().endswith(b"data: [DONE]") else "stream cut short"


async def _status(http: aiohttp.ClientSession, url: str, path: str, data: bytes | None,
                  body: dict[str, Any] | None, expected: int) -> str | None:
    async with http.post(url + path, data=data, json=body,
                         headers={"content-type": "application/json"} if data else None
                         ) as resp:
        await resp.read()
        return None if resp.status == expected else f"HTTP {resp.status} (not {expected})"


Request = Callable[[aiohttp.ClientSession, str], Awaitable[str | None]]


def mixed_request(rng: random.Random) -> tuple[str, Request]:
    """One request of the laneway waves: (its kind, how to send it and check it)."""
    prompt, roll = _prompt(rng), rng.random()
    if roll < 0.40:
        return _chat_stream(prompt)
    if roll < 0.60:
        return "chat", lambda h, u: _status(h, u, CHAT, None, chat_body("fast", 16, False, prompt),
                                            200)
    if roll < 0.70:
        body = {"model": "fast", "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                "stream": True}
        return "completion_stream", lambda h, u: _stream(h, u, COMPLETIONS, body)
    if roll < 0.80:
        # paced: the move completes while the stream runs (an unpaced one ends first)
        return "migration", lambda h, u: _stream(h, u, CHAT, chat_body("paced", 24, True, prompt),
                                                 {"x-laneway-migrate-after": "4"})
    if roll < 0.90:
        return "client_leaves", lambda h, u: _stream(
            h, u, CHAT, chat_body("paced", 50, True, prompt), leave_after=3)
    if roll < 0.95:
        return "malformed", lambda h, u: _status(h, u, CHAT, b'{"model": "fast", ', None, 400)
    return "unknown_model", lambda h, u: _status(h, u, CHAT, None,
                                                 chat_body("nope", 4, False, prompt), 404)


def plain_stream(rng: random.Random) -> tuple[str, Request]:
    """One request of the floor relay's waves (it relays to one fake, nothing else)."""
    return _chat_stream(_prompt(rng))


def _chat_stream(prompt: str) -> tuple[str, Request]:
    return "chat_stream", lambda h, u: _stream(h, u, CHAT, chat_body("fast", 16, True, prompt))


async def wave(http: aiohttp.ClientSession, url: str, requests: list[tuple[str, Request]],
               concurrency: int, timeout_s: float) -> dict[str, int]:
    """Send `requests` at `concurrency`; failures by kind and what went wrong."""
    slots = asyncio.Semaphore(concurrency)
    failures: Counter[str] = Counter()

    async def one(kind: str, send: Request) -> None:
        async with slots:
            try:
                async with asyncio.timeout(timeout_s):
                    wrong = await send(http, url)
            except (aiohttp.ClientError, TimeoutError) as exc:
                wrong = type(exc).__name__
            if wrong is not None:
                failures[f"{kind}: {wrong}"] += 1

    await asyncio.gather(*(one(kind, send) for kind, send in requests))
    return dict(failures)


async def growth(url: str, plan: Plan, make: Callable[[random.Random], tuple[str, Request]],
                 measure: Callable[[], int]) -> dict[str, Any]:
    """`measure()` (KB) after each wave of `plan.wave_requests` requests made by `make`.
    Each wave has its own client, closed before the measure: the server's side of its
    connections is gone then, and only what requests left behind remains."""
    rng = random.Random(plan.seed)
    sent: list[int] = []
    after: list[int] = []
    failures: Counter[str] = Counter()
    for n in range(plan.waves):
        batch = [make(rng) for _ in range(plan.wave_requests)]
        async with client() as http:
            failures.update(await wave(http, url, batch, plan.concurrency, plan.timeout_s))
        await asyncio.sleep(1.0)  # the last streams' cleanup (a left client's upstream)
        sent.append((n + 1) * plan.wave_requests)
        after.append(measure())
    kept = slice(plan.warmup_waves, None)
    return {"requests_after_wave": sent, "kb_after_wave": after,
            "growth_kb_per_1k_requests": slope_per_1k(sent[kept], after[kept]),
            "growth_kb_after_warmup": after[-1] - after[plan.warmup_waves - 1]
            if plan.warmup_waves else after[-1] - after[0],
            "failures": dict(failures)}


async def held_streams(http: aiohttp.ClientSession, url: str, pid: int, model: str,
                       count: int, tokens: int, timeout_s: float) -> dict[str, Any]:
    """Memory while `count` streams of `model` are all open (peak of samples taken until
    the first of them ends), then wait for them to end. A stream that fails before its
    first chunk counts as settled, so a failure is reported, not waited on."""
    started = asyncio.Event()
    settled = 0

    def settled_one() -> None:
        nonlocal settled
        settled += 1
        if settled == count:
            started.set()

    async def one(n: int) -> str | None:
        body = chat_body(model, tokens, True, f"held stream {n}")
        opened = False

        def opened_one() -> None:
            nonlocal opened
            opened = True
            settled_one()

        try:
            return await _stream(http, url, CHAT, body, on_first=opened_one)
        finally:
            if not opened:
                settled_one()

    tasks = [asyncio.ensure_future(one(n)) for n in range(count)]
    try:
        async with asyncio.timeout(timeout_s):
            await started.wait()
        peak = 0
        while not any(t.done() for t in tasks):
            peak = max(peak, rss_kb(pid)["RssAnon"])
            await asyncio.sleep(0.1)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                          timeout_s)
    finally:
        for task in tasks:
            task.cancel()
    failed = [o for o in outcomes if o is not None]
    return {"model": model, "streams": count, "tokens": tokens, "rss_anon_kb_open": peak,
            "failed_streams": len(failed),
            "errors": sorted({str(o) for o in failed})[:5]}


Target = tuple[str, int]  # a server's URL and its pid


async def measure_system(waves: Target, streams: Mapping[str, Target], plan: Plan,
                         make: Callable[[random.Random], tuple[str, Request]],
                         metrics: bool = True) -> dict[str, Any]:
    """Warm-up, idle memory, growth over the waves (on `waves`), then memory per open
    stream (on `streams[model]` for each held model, from that server's memory before
    its first held streams). `metrics`: read the server's /metrics at the end. Each
    phase has its own client: none reuses a connection the server closed while idle."""
    async with client() as http:
        warm = [make(random.Random(plan.seed + 1)) for _ in range(200)]
        warm_failures = await wave(http, waves[0], warm, plan.concurrency, plan.timeout_s)
        for model, (url, pid) in streams.items():
            warmed = await held_streams(http, url, pid, model, 16, 3, plan.timeout_s)
            warm_failures |= {f"held {model}: {e}": 1 for e in warmed["errors"]}
    await asyncio.sleep(1.0)
    idle = rss_kb(waves[1])
    grown = await growth(waves[0], plan, make, lambda: rss_kb(waves[1])["RssAnon"])
    before = {pid: rss_kb(pid)["RssAnon"] for _, pid in streams.values()}
    held = []
    for model, count in plan.held:
        url, pid = streams[model]
        async with client() as http:
            run = await held_streams(http, url, pid, model, count, held_tokens(plan, model),
                                     plan.timeout_s)
        run["rss_anon_kb_before"] = before[pid]
        run["kb_per_open_stream"] = (run["rss_anon_kb_open"] - before[pid]) / count
        held.append(run)
        await asyncio.sleep(1.0)
    result = {"idle_rss_kb": idle["VmRSS"], "idle_rss_anon_kb": idle["RssAnon"],
              "warmup_failures": warm_failures, "growth": grown, "open_streams": held}
    if metrics:
        async with client() as http, http.get(waves[0] + "/metrics") as resp:
            page = await resp.text()
        result |= {"migrations": metric_total(page, "laneway_migrations_total"),
                   "client_disconnects": metric_total(
                       page, "laneway_client_disconnects_total")}
    return result


def metric_total(page: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus text page's samples of `name` over their labels; with
    `labels` (their first ones as the page writes them, e.g. 'backend="b1"'), over the
    samples that start with those."""
    starts = (f"{name}{{{labels}",) if labels else (name + "{", name + " ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(starts))


# -- the processes ------------------------------------------------------------------
def laneway_config(fast: str, paced: list[str], held: str, frozen_moves: bool = False
                   ) -> dict[str, Any]:
    """laneway's defaults (round_robin; streams tracked for migration): one `fast`
    backend, two `paced` (a migration has somewhere to go), one `held`."""
    config: dict[str, Any] = {
        "backends": [{"name": "fast", "url": fast, "model": "fast"},
                     {"name": "held", "url": held, "model": "held"}]
        + [{"name": f"paced{i}", "url": url, "model": "paced"} for i, url in enumerate(paced)],
        "server": {"log_level": "warning"},
        "debug": {"allow_forced_migration": True}}
    if frozen_moves:
        config["migration"] = {"warm_prefill": False, "pace_slowdown": 0}
    return config


@contextlib.contextmanager
def laneway_fleet(plan: Plan) -> Iterator[dict[str, Any]]:
    """Fresh fakes for laneway; yields its config."""
    with fake_process(0, "fast") as fast, fake_process(plan.tpot_ms, "paced") as paced_a, \
            fake_process(plan.tpot_ms, "paced") as paced_b, \
            fake_process(plan.held_tpot_ms, "held") as held:
        yield laneway_config(fast, [paced_a, paced_b], held, plan.frozen_moves)


async def traced_growth(config: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The growth waves through laneway run in this process, measured by Python's own
    allocation tracing (tracemalloc, after a full collection) instead of RssAnon: what
    objects stay allocated, without the allocator's arenas and fragmentation. The load
    generator's allocations count too (its client is closed before each measure)."""
    settings = Settings.model_validate({**config, "server": {
        **config["server"], "host": "127.0.0.1", "port": 0}})
    async with serve_in_loop(settings) as proxy:
        async with client() as http:
            warm = [mixed_request(random.Random(plan.seed + 1)) for _ in range(200)]
            await wave(http, proxy.url, warm, plan.concurrency, plan.timeout_s)

        def traced_kb() -> int:
            gc.collect()
            return tracemalloc.get_traced_memory()[0] // 1024

        tracemalloc.start()
        try:
            return await growth(proxy.url, plan, mixed_request, traced_kb)
        finally:
            tracemalloc.stop()


def run(plan: Plan, log_path: Path | None = None) -> dict[str, Any]:
    """laneway, laneway traced in this process, then the floor relays; each in front of
    its own fresh fakes."""
    models = {model for model, _ in plan.held}
    with laneway_fleet(plan) as config, \
            running_proxy(config, log_path=log_path) as proxy:
        wait_ok(f"{proxy.url}/health")
        target = (proxy.url, proxy.pid)
        result = {"laneway": asyncio.run(measure_system(
            target, dict.fromkeys(models, target), plan, mixed_request))}
    with laneway_fleet(plan) as config:
        result["laneway_traced"] = asyncio.run(traced_growth(config, plan))
    # A bare relay relays to one upstream: one in front of the fast fake for the waves
    # (plain streams), one in front of a fake of each held model.
    with contextlib.ExitStack() as stack:
        fast_relay = stack.enter_context(minimal_relay(
            stack.enter_context(fake_process(0, "fast"))))
        relays = {model: stack.enter_context(minimal_relay(stack.enter_context(
            fake_process(plan.held_tpot_ms if model == "held" else plan.tpot_ms, model))))
            for model in sorted(models)}
        result["floor"] = asyncio.run(measure_system(fast_relay, relays, plan,
                                                     plain_stream, metrics=False))
    return result


def verdict(result: dict[str, Any]) -> dict[str, bool]:
    held = [r for r in result["laneway"]["open_streams"] if r["model"] == "held"]
    return {"kb_per_open_stream": max(r["kb_per_open_stream"] for r in held)
            <= TARGETS["kb_per_open_stream"],
            "growth_kb_per_1k_requests": result["laneway_traced"]
            ["growth_kb_per_1k_requests"] <= TARGETS["growth_kb_per_1k_requests"]}


def table(result: dict[str, Any]) -> str:
    lane, floor = result["laneway"], result["floor"]
    lines = ["| measure | laneway | bare relay (floor) |", "|---|---|---|",
             f"| idle heap (RssAnon) / resident (VmRSS) | {lane['idle_rss_anon_kb'] / 1024:.1f}"
             f" / {lane['idle_rss_kb'] / 1024:.1f} MB | "
             f"{floor['idle_rss_anon_kb'] / 1024:.1f} / {floor['idle_rss_kb'] / 1024:.1f} MB |"]
    for mine, theirs in zip(lane["open_streams"], floor["open_streams"], strict=True):
        lines.append(f"| per open stream, {mine['streams']} open x {mine['tokens']} tokens "
                     f"({mine['model']}) | "
                     f"{mine['kb_per_open_stream']:.1f} KB (failed {mine['failed_streams']}) | "
                     f"{theirs['kb_per_open_stream']:.1f} KB (failed "
                     f"{theirs['failed_streams']}) |")
    lines.append(f"| forced migrations / clients that left, all phases | "
                 f"{lane['migrations']:.0f} / {lane['client_disconnects']:.0f} | |")
    lg, fg, tg = lane["growth"], floor["growth"], result["laneway_traced"]
    for label, mine, theirs in (("RssAnon", lg, fg), ("Python objects (tracemalloc)", tg, None)):
        lines.append(f"| growth after warm-up, {label}, {mine['requests_after_wave'][-1]} "
                     f"requests | {_growth(mine)} | {_growth(theirs) if theirs else ''} |")
    return "\n".join(lines)


def _growth(run: dict[str, Any]) -> str:
    return (f"{run['growth_kb_per_1k_requests']:+.1f} KB / 1000 requests "
            f"({run['growth_kb_after_warmup']:+d} KB; failures {sum(run['failures'].values())})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run (~30 s)")
    parser.add_argument("--waves", type=int, default=DEFAULT.waves)
    parser.add_argument("--wave-requests", type=int, default=DEFAULT.wave_requests)
    parser.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "memory.json")
    parser.add_argument("--proxy-log", type=Path, help="keep laneway's log here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan(waves=args.waves, wave_requests=args.wave_requests)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the children
    started = time.monotonic()
    result: dict[str, Any] = {"plan": asdict(plan), **run(plan, args.proxy_log)}
    result |= {"targets": TARGETS, "meets_targets": verdict(result),
               "wall_s": round(time.monotonic() - started, 1),
               "command": "python -m bench.studies.memory " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "commit": git_commit()}
    publish(args.json, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
