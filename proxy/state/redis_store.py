"""Shared state in Redis: one pipelined transaction per sync tick (plus one read of
the other replicas' in-flight hashes).

Keys (all under `state.key_prefix`, `laneway` by default):
* `<p>:log`              stream of table writes, trimmed to ~`log_max_entries` batches;
                         fields `r` (replica id), `t` (table), `d` (JSON list of writes)
* `<p>:c:<counter>`      float counters (rate-limit windows), expiring with their window
* `<p>:inflight:<id>`    hash backend -> open requests of replica `id`, with a TTL of
                         `inflight_ttl_s`, refreshed every tick
* `<p>:replicas`         sorted set replica id -> last tick (wall clock)
* `<p>:apikeys`          hash sha256 hex -> JSON key settings (`laneway keys add`)
* `<p>:slots:<backend>`  hash replica id -> "held:need", the slot leases of strict flow
                         control (`lease_slots`); a replica no longer in `<p>:replicas`
                         is dropped from it by the next lease
* `<p>:flow`             hash replica id -> its flow-control mode ("strict, 4 per
                         backend"), written every tick; a replica no longer in
                         `<p>:replicas` is dropped from it by the next tick's reader
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.config import StateConfig
from proxy.state.base import Inbox, Outbox, StoreUnavailable

# One replica's slot leases on every backend, in one atomic step. A replica's entry is
# what it holds (its lease, or more while requests opened under an earlier, larger
# lease are still open) and what it needs. A lease never takes a slot another live
# replica holds, so the holdings add up to at most the limit (README, Flow control).
# `cap`: the most slots to grant on each backend.
_LEASE = """
local me, limit, ttl, cap = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local live = math.max(1, redis.call('ZCARD', KEYS[1]))
local grants = {}
for i = 2, #KEYS do
  local key, open, need = KEYS[i], tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
  local held, needed = 0, need
  local entries = redis.call('HGETALL', key)
  for j = 1, #entries, 2 do
    local who = entries[j]
    if who ~= me then
      if redis.call('ZSCORE', KEYS[1], who) then
        local sep = string.find(entries[j + 1], ':', 1, true)
        held = held + tonumber(string.sub(entries[j + 1], 1, sep - 1))
        needed = needed + tonumber(string.sub(entries[j + 1], sep + 1))
      else
        redis.call('HDEL', key, who)
      end
    end
  end
  local target
  if needed <= limit then
    target = need + math.floor((limit - needed) / live)
  else
    target = math.ceil(limit * need / needed)
  end
  local grant = math.max(0, math.min(target, limit - held, cap))
  redis.call('HSET', key, me, math.max(grant, open) .. ':' .. need)
  redis.call('PEXPIRE', key, ttl)
  grants[#grants + 1] = grant
end
return grants
"""
COUNTER_TTL_S = 180  # counters are per-minute windows; two windows are read back
_LOG_READ_BATCH = 2000


class RedisStore:
    name = "redis"

    def __init__(self, cfg: StateConfig, replica_id: str) -> None:
        self._cfg = cfg
        self.replica_id = replica_id
        self._p = cfg.key_prefix
        self._client = aioredis.Redis.from_url(
            cfg.redis_url, max_connections=cfg.max_connections,
            socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
            health_check_interval=30)
        self._log_cursor: str | None = None  # last log entry id read; None: not started
        self._lease = self._client.register_script(_LEASE)

    async def exchange(self, outbox: Outbox, counters: Collection[str]) -> Inbox:
        try:
            if self._log_cursor is None:
                self._log_cursor = await self._log_start()
            return await self._exchange(outbox, list(counters))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _log_start(self) -> str:
        """Start reading the log where a ~full index is still in it: its oldest entry."""
        first = await self._client.xrange(f"{self._p}:log", count=1)
        return "0-0" if not first else _prev_id(_text(first[0][0]))

    async def _exchange(self, outbox: Outbox, counters: list[str]) -> Inbox:
        p, me, now = self._p, self.replica_id, time.time()
        ttl_s = self._cfg.inflight_ttl_s
        pipe = self._client.pipeline(transaction=True)
        for key, amount in outbox.counters.items():
            pipe.incrbyfloat(f"{p}:c:{key}", amount)
            pipe.expire(f"{p}:c:{key}", COUNTER_TTL_S)
        for table, writes in outbox.entries.items():
            if writes:
                pipe.xadd(f"{p}:log", {"r": me, "t": table, "d": orjson.dumps(writes)},
                          maxlen=self._cfg.log_max_entries, approximate=True)
        mine = f"{p}:inflight:{me}"
        pipe.delete(mine)
        if outbox.inflight:
            pipe.hset(mine, mapping=dict(outbox.inflight.items()))
            pipe.pexpire(mine, int(ttl_s * 1000))
        if outbox.flow:
            pipe.hset(f"{p}:flow", me, outbox.flow)
            pipe.pexpire(f"{p}:flow", int(ttl_s * 1000))
        at_me = len(pipe)
        pipe.zadd(f"{p}:replicas", {me: now})  # 1: this replica was not there
        pipe.zremrangebyscore(f"{p}:replicas", "-inf", now - ttl_s)
        at_replicas = len(pipe)
        pipe.zrange(f"{p}:replicas", 0, -1)
        pipe.hgetall(f"{p}:flow")
        if counters:
            pipe.mget([f"{p}:c:{key}" for key in counters])
        cursor: str = self._log_cursor or "0-0"
        pipe.xread({f"{p}:log": cursor}, count=_LOG_READ_BATCH)
        results = await pipe.execute()
        replicas = [r.decode() for r in results[at_replicas]]
        flows = {_text(who): _text(mode) for who, mode in results[at_replicas + 1].items()}
        inbox = Inbox(replicas=len(replicas), rejoined=results[at_me] == 1)
        for who in replicas:
            if who in flows:
                inbox.flows[flows[who]] = inbox.flows.get(flows[who], 0) + 1
        totals = results[at_replicas + 2] if counters else []
        inbox.counters = {key: float(v) if v is not None else 0.0
                          for key, v in zip(counters, totals, strict=True)}
        self._read_log(results[-1], inbox)
        inbox.inflight = await self._sum_inflight_and_forget(
            [r for r in replicas if r != me], gone=set(flows).difference(replicas))
        return inbox

    def _read_log(self, log_read: Any, inbox: Inbox) -> None:
        for _stream, entries in log_read or ():
            for entry_id, fields in entries:
                self._log_cursor = entry_id.decode()
                if fields[b"r"].decode() == self.replica_id:
                    continue
                inbox.entries.setdefault(fields[b"t"].decode(), []).extend(
                    orjson.loads(fields[b"d"]))

    async def _sum_inflight_and_forget(self, replicas: list[str], gone: set[str]
                                       ) -> dict[str, int]:
        """The sync's second round trip: the open requests of the other live
        `replicas`, summed per backend, and the flow modes of replicas `gone` (crashed
        ones, whose entries outlived them) deleted."""
        if not replicas and not gone:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for replica in replicas:
            pipe.hgetall(f"{self._p}:inflight:{replica}")
        if gone:
            pipe.hdel(f"{self._p}:flow", *gone)
        total: dict[str, int] = {}
        for counts in (await pipe.execute())[:len(replicas)]:
            for backend, count in counts.items():
                name = backend.decode()
                total[name] = total.get(name, 0) + int(count)
        return total

    async def api_keys(self) -> dict[str, dict[str, Any]]:
        try:
            raw = await self._client.hgetall(f"{self._p}:apikeys")
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        keys: dict[str, dict[str, Any]] = {}
        for digest, settings in raw.items():
            value = orjson.loads(settings)
            if isinstance(value, dict):
                keys[_text(digest)] = value
        return keys

    async def lease_slots(self, limit: int, needs: Mapping[str, tuple[int, int]],
                          cap: int | None = None) -> dict[str, int]:
        names = list(needs)
        keys = [f"{self._p}:replicas", *(f"{self._p}:slots:{name}" for name in names)]
        args: list[str | int] = [self.replica_id, limit,
                                 int(self._cfg.inflight_ttl_s * 10_000),
                                 limit if cap is None else cap]
        for name in names:
            args.extend(needs[name])
        try:
            grants = await self._lease(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return {name: int(grant) for name, grant in zip(names, grants, strict=True)}

    async def close(self) -> None:
        """Leave at once: drop this replica's in-flight counts instead of waiting out
        their TTL."""
        try:
            await self._client.delete(f"{self._p}:inflight:{self.replica_id}")
            await self._client.zrem(f"{self._p}:replicas", self.replica_id)
            await self._client.hdel(f"{self._p}:flow", self.replica_id)
            # its slot leases go with it: the next lease of each other replica drops
            # an entry whose replica is no longer in `<p>:replicas`
        except (RedisError, OSError):
            pass
        await self._client.aclose()


def _prev_id(entry_id: str) -> str:
    """The stream id just before `entry_id` (XREAD returns entries after its cursor)."""
    ms, seq = (int(part) for part in entry_id.split("-"))
    return f"{ms}-{seq - 1}" if seq else f"{ms - 1}-18446744073709551615"


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
