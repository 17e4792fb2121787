"""`make demo`: real vLLM-CPU backends + the proxy + a short real workload.

Starts a heterogeneous fleet of tiny models (`python -m bench backends up`), starts the proxy
in front of it, sends a mixed streaming / non-streaming workload of alpaca_eval
prompts through the official openai SDK, prints a per-backend table, saves a plot,
and stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import yaml

from bench.harness.proxy_process import running_proxy
from bench.harness.report import pct
from predictors.home import DATASETS, REPO, open_text

STATE = REPO / ".laneway"


@dataclass
class Result:
    backend: str
    model: str
    stream: bool
    ttft_s: float | None
    e2e_s: float
    tokens: int
    error: str | None = None


def load_prompts(shared: Path, n: int) -> list[str]:
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as f:
        rows = [json.loads(line) for _, line in zip(range(n), f, strict=False)]
    return [row["instruction"] for row in rows]


async def one(sdk: openai.AsyncOpenAI, model: str, prompt: str, stream: bool) -> Result:
    started = time.perf_counter()
    messages: Any = [{"role": "user", "content": prompt[:600]}]
    try:
        if not stream:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=48)
            completion = raw.parse()
            tokens = completion.usage.completion_tokens if completion.usage else 0
            return Result(raw.headers["x-laneway-backend"], model, False, None,
                          time.perf_counter() - started, tokens)
        ttft, tokens = None, 0
        raw_stream = await sdk.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=48,
            stream=True, stream_options={"include_usage": True})
        async for chunk in raw_stream.parse():
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - started
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return Result(raw_stream.headers["x-laneway-backend"], model, True, ttft,
                      time.perf_counter() - started, tokens)
    except openai.APIError as exc:
        return Result("-", model, stream, None, time.perf_counter() - started, 0, str(exc))


async def workload(url: str, models: list[str], prompts: list[str], concurrency: int
                   ) -> list[Result]:
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0,
                                  timeout=300) as sdk:
        async def run(i: int, prompt: str) -> Result:
            async with gate:
                # streaming alternates every other pair, so every model sees both modes
                return await one(sdk, models[i % len(models)], prompt, stream=i // 2 % 2 == 0)

        return await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))


def table(results: list[Result]) -> str:
    lines = ["| backend | model | requests | errors | TTFT p50 ms | TTFT p99 ms | TPOT ms |",
             "|---|---|---|---|---|---|---|"]
    for backend in sorted({r.backend for r in results}):
        rows = [r for r in results if r.backend == backend]
        ok = [r for r in rows if r.error is None]
        ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        tpots = [(r.e2e_s - r.ttft_s) * 1000 / (r.tokens - 1)
                 for r in ok if r.ttft_s is not None and r.tokens > 1]
        cells = [backend, rows[0].model, str(len(rows)), str(len(rows) - len(ok)),
                 f"{pct(ttfts, 0.5):.0f}" if ttfts else "-",
                 f"{pct(ttfts, 0.99):.0f}" if ttfts else "-",
                 f"{statistics.mean(tpots):.1f}" if tpots else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for backend in sorted({r.backend for r in results if r.error is None}):
        e2e = sorted(r.e2e_s for r in results if r.backend == backend and r.error is None)
        ax.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=backend)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("CDF")
    ax.set_title("laneway demo: latency per backend")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


async def show_migration(url: str, model: str) -> tuple[bool, str]:
    """One stream moved mid-flight (forced) beside the same request left alone."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0,
                                  timeout=120) as sdk:
        async def text(headers: dict[str, str]) -> str:
            stream = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Tell me about lighthouses."}],
                max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True},
                extra_headers=headers)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])

        alone = await text({})
        moved = await text({"x-laneway-migrate-after": "24"})
    metrics = await asyncio.to_thread(_get, f"{url}/metrics")
    moves = [line for line in metrics.splitlines()
             if line.startswith("laneway_migrations_total{")]
    stalls = [line for line in metrics.splitlines()
              if line.startswith(("laneway_handoff_stall_seconds_sum",
                                  "laneway_handoff_stall_seconds_count"))]
    return moved == alone, "\n".join(moves + stalls)


def _get(url: str) -> str:
    import httpx

    return str(httpx.get(url, timeout=10).text)


def _shared_model(config: dict[str, Any]) -> str:
    """A model served by two backends (so a stream has somewhere to move)."""
    models: list[str] = [b["model"] for b in config["backends"]]
    return max(set(models), key=models.count)


def dev_tool(*args: str) -> None:
    """`python -m bench ARGS` (local backends), in the checkout."""
    subprocess.run([sys.executable, "-m", "bench", *args], check=True, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--requests", type=int, default=36)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--policy", default="least_request")
    args = parser.parse_args(argv)
    config_path = STATE / "demo.yaml"
    dev_tool("backends", "up", "--n", "3", "--variants", "small,small,large",
            "--config-out", str(config_path), "--shared", str(args.shared))
    try:
        config: dict[str, Any] = yaml.safe_load(config_path.read_text())
        config["policy"] = {"name": args.policy, "params": {}}
        config["debug"] = {"allow_forced_migration": True}  # for the migration showcase
        models = sorted({b["model"] for b in config["backends"]})
        prompts = load_prompts(args.shared, args.requests)
        with running_proxy(config) as proxy:
            url = proxy.url
            print(f"proxy at {url} ({args.policy}) over {len(config['backends'])} backends; "
                  f"sending {len(prompts)} requests to {', '.join(models)}")
            started = time.perf_counter()
            results = asyncio.run(workload(url, models, prompts, args.concurrency))
            wall = time.perf_counter() - started
            same, moves = asyncio.run(show_migration(url, _shared_model(config)))
        print(table(results))
        errors = sum(r.error is not None for r in results)
        print(f"\n{len(results)} requests in {wall:.1f}s, {errors} errors")
        png = STATE / "demo.png"
        plot(results, png)
        print(f"plot: {png}")
        print("\nmigration: a stream moved to another backend after 24 tokens "
              f"(x-laneway-migrate-after); same text as unmoved: {same}\n{moves}")
        return 1 if errors or not same or "laneway_migrations_total" not in moves else 0
    finally:
        dev_tool("backends", "down")


if __name__ == "__main__":
    sys.exit(main())
