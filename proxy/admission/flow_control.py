"""Flow control: requests wait in the proxy while every backend of their model is full.

With `flow_control.max_inflight_per_backend` set, a backend holding that many open
requests (every replica's, as the policies see them) takes no new one. A request for a
model whose every routable backend is full waits here, and the waiting requests leave
as backends free up: higher priority first (a key's `priority`), fairly across keys
within a priority (round-robin over the keys, first come first served within a key).

The policy still picks the backend, when the request leaves and only among those with
room: late binding, so a request goes to the backend that freed first instead of
queueing inside one vLLM behind others. A queue longer than `max_queued` or a wait
longer than `queue_timeout_s` is answered 503 `overloaded` with Retry-After, so an
overload sheds load with a clear error instead of timing out.

Moves of running streams (migration) are never held: their request was admitted.

With several replicas (`state.backend: redis`), `strict` (the default) holds the limit
across them: a replica opens requests on a backend only within the slots it leased in
the shared store (`Store.lease_slots`, renewed at every sync with this replica's open
and waiting requests as its need), and what the replicas hold never adds up to more
than the limit. Without it each counts the others' open requests as of the last sync,
and replicas whose requests end at once refill the same room together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping

from proxy.config import FlowControlConfig, Settings
from proxy.errors import Overloaded
from proxy.fleet.registry import Registry
from proxy.observability.metrics import Metrics
from proxy.state.base import equal_share
from proxy.types import Backend, ClusterView

log = logging.getLogger("laneway")
_TICK_S = 0.05  # while requests wait: look for room this often (drains, health, replicas)


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
    """Where a held request queues: higher `priority` leaves first; within a priority
    the `tenant`s (API keys) take turns."""

    priority: int = 0
    tenant: str = ""


ANYONE = Place()  # no key, no priority header


@dataclasses.dataclass(eq=False)
class _Waiter:
    model: str
    place: Place
    exclude: tuple[str, ...]
    seq: int
    future: asyncio.Future[str]  # the backend whose room it was given (reserved)


# model -> priority -> tenant -> its waiting requests, oldest first. The tenants'
# order is the round-robin: the tenant served goes to the back.
_Lanes = dict[str, dict[int, OrderedDict[str, deque[_Waiter]]]]


class FlowControl:
    def __init__(self, settings: Callable[[], Settings], registry: Registry,
                 metrics: Metrics) -> None:
        """`settings`: the proxy's settings now (flow_control reloads at once)."""
        self._settings, self._registry, self._metrics = settings, registry, metrics
        self._lanes: _Lanes = {}
        self._queued = 0
        self._reserved: dict[str, int] = {}  # room given to woken requests not yet there
        self._seq = itertools.count()
        self._tick: asyncio.TimerHandle | None = None
        self._leases: dict[str, int] = {}  # strict: this replica's slots per backend
        self.on_short: Callable[[], None] | None = None  # strict: a request waits
        registry.on_release = self._released

    @property
    def queued(self) -> int:
        """Requests waiting for room now."""
        return self._queued

    async def view(self, model: str, exclude: list[str], place: Place = ANYONE
                   ) -> ClusterView:
        """The routable backends of `model` (not in `exclude`) that have room, waiting
        for room if every one is full; all of them when flow control is off. An empty
        view when none is routable (the caller's retry window or 503 decides)."""
        view = self._registry.view(model, time.monotonic(), exclude)
        cfg = self._settings().flow_control
        if cfg.max_inflight_per_backend == 0 or not view.candidates:
            return view
        if model not in self._lanes and (room := self._room(view)):
            return dataclasses.replace(view, candidates=room)
        deadline = time.monotonic() + cfg.queue_timeout_s
        started = time.monotonic()
        seq = next(self._seq)  # its place in line, kept if it must wait again
        while True:
            backend = await self._wait(model, tuple(exclude), place, seq, deadline, cfg)
            self._unreserve(backend)
            view = self._registry.view(model, time.monotonic(), exclude)
            if room := self._room(view):
                self._metrics.flow_wait.labels(model, str(place.priority)).observe(
                    time.monotonic() - started)
                return dataclasses.replace(view, candidates=room)
            if not view.candidates:
                return view
            # The room went (a replica took it, the backend left): wait again, at the
            # head of its key's line (it keeps its sequence number).

    async def _wait(self, model: str, exclude: tuple[str, ...], place: Place, seq: int,
                    deadline: float, cfg: FlowControlConfig) -> str:
        if self._queued >= cfg.max_queued:
            raise self._shed(model, place, "queue_full",
                             f"{self._queued} requests are waiting for a backend "
                             "(flow_control.max_queued); try again later.")
        waiter = _Waiter(model, place, exclude, seq,
                         asyncio.get_running_loop().create_future())
        self._enqueue(waiter)
        self._pump()  # there may be room that waiters ahead cannot use (their exclusions)
        if self._strict() and not waiter.future.done() and self.on_short is not None:
            self.on_short()  # lease more slots now rather than at the next sync
        taken = False
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                backend = await asyncio.shield(waiter.future)
            taken = True
            return backend
        except TimeoutError:
            if waiter.future.done():  # room came as the time ran out: take it
                taken = True
                return waiter.future.result()
            raise self._shed(
                model, place, "timeout",
                f"Every backend of `{model}` stayed full for {cfg.queue_timeout_s:g} s "
                "(flow_control.queue_timeout_s); try again later.") from None
        finally:
            if not waiter.future.done():
                self._dequeue(waiter)
                waiter.future.cancel()
            elif not taken:  # left (the client went away) as room was given: pass it on
                self._unreserve(waiter.future.result())
                self._pump()

    def _shed(self, model: str, place: Place, reason: str, message: str) -> Overloaded:
        self._metrics.flow_rejected.labels(model, reason).inc()
        log.warning("flow control shed a request for %s (priority %d, %s): %s; "
                    "%d waiting", model, place.priority, reason, message, self._queued)
        return Overloaded(message, retry_after_s=self._settings().server.retry_after_s)

    def for_move(self, view: ClusterView, *, required: bool) -> ClusterView:
        """Where a running stream may move (it was admitted: it never waits in line):
        the backends of `view` with room. A move that must happen (the source failed or
        drains, a forced move) takes any backend when none has room, one request over
        the limit beside losing the stream; an optional one (a policy's) gets an empty
        view and stays where it is."""
        if self._settings().flow_control.max_inflight_per_backend == 0:
            return view
        room = self._room(view)
        if len(room) == len(view.candidates) or (required and not room):
            return view
        return dataclasses.replace(view, candidates=room)

    def has_room(self, backend: Backend) -> bool:
        """Whether `backend` takes one more request now (always, with flow control off):
        a race's delayed hedge asks before it opens (proxy/relay/race.py)."""
        return bool(self._room(ClusterView((backend,), {}, {}, 0.0)))

    def _room(self, view: ClusterView) -> tuple[Backend, ...]:
        settings = self._settings()
        cfg = settings.flow_control
        if cfg.max_inflight_per_backend == 0:  # turned off by a reload: none is full
            return view.candidates
        reserved = self._reserved
        if self._strict(settings):  # within this replica's leased slots
            local, leases = self._registry.local_inflight, self._leases
            return tuple(b for b in view.candidates if local.get(b.name, 0)
                         + reserved.get(b.name, 0) < leases.get(b.name, 0))
        limit, inflight = cfg.max_inflight_per_backend, self._registry.inflight
        return tuple(b for b in view.candidates
                     if inflight.get(b.name, 0) + reserved.get(b.name, 0) < limit)

    # -- strict: slot leases (the shared state's sync asks for them) ----------------
    def _strict(self, settings: Settings | None = None) -> bool:
        """Whether requests open only within leased slots: `strict` with a limit, and
        replicas that share state (one process leases every slot: it needs no lease).
        `settings`: the ones now, if the caller has them."""
        settings = settings or self._settings()
        cfg = settings.flow_control
        return cfg.strict and cfg.max_inflight_per_backend > 0 \
            and settings.state.backend == "redis"

    def lease_needs(self) -> tuple[int, dict[str, tuple[int, int]]] | None:
        """(the limit, backend -> (what this replica holds there, the requests open or
        promised there plus the waiting ones it could take)) to lease slots for; None
        when not strict. What it holds is its current lease, or more while more are
        open: requests may open within the current lease while the new one is on its
        way, so the store must not give those slots to another replica before the
        lease after it (which then reports the smaller lease, or what is open)."""
        if not self._strict():
            return None
        local, reserved, leases = self._registry.local_inflight, self._reserved, self._leases
        opened = {b.name: local.get(b.name, 0) + reserved.get(b.name, 0)
                  for b in self._registry.all()}
        needs = dict(opened)
        now = time.monotonic()
        for model, lanes in self._lanes.items():
            waiting = sum(len(fifo) for tenants in lanes.values() for fifo in tenants.values())
            for backend in self._registry.view(model, now).candidates:
                needs[backend.name] += waiting
        return self._settings().flow_control.max_inflight_per_backend, {
            name: (max(count, leases.get(name, 0)), needs[name])
            for name, count in opened.items()}

    def leased(self, grants: Mapping[str, int]) -> None:
        """This replica's slots now; waiting requests take the new ones at once."""
        if grants != self._leases:
            log.debug("strict flow control: slots leased %s (were %s); %d waiting",
                      _slots(grants), _slots(self._leases), self._queued)
        self._leases = dict(grants)
        for name, slots in grants.items():
            self._metrics.flow_leased.labels(name).set(slots)
        if self._queued:
            self._pump()

    def lease_lost(self, replicas: int) -> None:
        """The shared store is gone for longer than the others keep this replica's
        leases, or was never reached (the others never saw this replica): keep to an
        equal part of each backend's limit (at least one slot). Nothing when not strict."""
        if not self._strict():
            return
        limit = self._settings().flow_control.max_inflight_per_backend
        share = equal_share(limit, replicas)
        shares = {b.name: share for b in self._registry.all()}
        if shares != self._leases:
            log.warning("strict flow control: no leases from the shared store (unreachable "
                        "since this replica started, or for longer than state.inflight_ttl_s);"
                        " keeping to %d of %d slots per backend (%d replicas last seen)",
                        share, limit, replicas)
        self.leased(shares)

    def flow_mode(self) -> str:
        """How this replica holds the limit, for the shared state to compare with the
        other replicas' (strict leases hold it only if every replica leases, each for
        the same limit)."""
        cfg = self._settings().flow_control
        if cfg.max_inflight_per_backend == 0:
            return "off"
        return f"{'strict' if cfg.strict else 'loose'}, " \
               f"{cfg.max_inflight_per_backend} per backend"

    def _enqueue(self, waiter: _Waiter) -> None:
        lanes = self._lanes.setdefault(waiter.model, {})
        fifo = lanes.setdefault(waiter.place.priority, OrderedDict()).setdefault(
            waiter.place.tenant, deque())
        if not fifo or fifo[-1].seq < waiter.seq:
            fifo.append(waiter)
        else:  # back again after losing its room: in line by arrival
            fifo.insert(next(i for i, w in enumerate(fifo) if w.seq > waiter.seq), waiter)
        self._queued += 1
        self._metrics.flow_queued.set(self._queued)
        self._arm()

    def _dequeue(self, waiter: _Waiter) -> None:
        lanes = self._lanes[waiter.model]
        tenants = lanes[waiter.place.priority]
        fifo = tenants[waiter.place.tenant]
        fifo.remove(waiter)
        if not fifo:
            del tenants[waiter.place.tenant]
            if not tenants:
                del lanes[waiter.place.priority]
                if not lanes:
                    del self._lanes[waiter.model]
        self._queued -= 1
        self._metrics.flow_queued.set(self._queued)

    def _released(self, _name: str) -> None:
        if self._queued:
            self._pump()

    def _pump(self) -> None:
        """Give room to waiting requests, best first, while there is room."""
        now = time.monotonic()
        while self._queued:
            best: _Waiter | None = None
            best_room: tuple[Backend, ...] = ()
            for model, lanes in self._lanes.items():
                priority = max(lanes)
                head = next(iter(lanes[priority].values()))[0]
                if best is not None and (priority, -head.seq) <= (best.place.priority,
                                                                  -best.seq):
                    continue
                if room := self._room(self._registry.view(model, now, head.exclude)):
                    best, best_room = head, room
            if best is None:
                return
            tenants = self._lanes[best.model][best.place.priority]
            tenants.move_to_end(best.place.tenant)  # round-robin over the tenants
            self._dequeue(best)
            backend = min(best_room, key=lambda b: self._registry.inflight.get(b.name, 0))
            self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
            best.future.set_result(backend.name)

    def _unreserve(self, name: str) -> None:
        left = self._reserved.get(name, 0) - 1
        if left > 0:
            self._reserved[name] = left
        else:
            self._reserved.pop(name, None)

    def _arm(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        if self._queued:
            self._pump()
            if self._queued:
                self._arm()


def _slots(grants: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {slots}" for name, slots in sorted(grants.items())) or "none"
