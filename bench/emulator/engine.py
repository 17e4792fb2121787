"""One emulated vLLM engine: continuous batching on a step-time model, no model.

The scheduler follows vLLM's V1 scheduler. Each step it first serves the running
requests in arrival order (one token each when decoding, the rest of the prompt as a
chunk when prefilling), within a budget of `max_num_batched_tokens`; a request whose
KV blocks cannot grow preempts the newest running request (recompute: its blocks are
released and it goes back to the head of the queue). If nothing was preempted, it
then admits waiting requests, up to `max_num_seqs`, after looking up their prompt's
full blocks in the prefix cache: cached tokens are not computed again. A step then
lasts `profile.step.seconds(...)`; at its end every request whose computed tokens
reached its length samples one token.

The engine is driven by loop timers, not a task: an idle engine costs nothing, so
hundreds fit in one process. Step ends follow an absolute schedule (no drift); when
the loop runs late, the next step starts at once and the lag is counted.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from bench.emulator.kv import KvCache, block_hash
from bench.emulator.profile import Profile
from bench.emulator.sequence import Sequence
from bench.fakes.fake_metrics import FakeStats

__all__ = ["Engine", "Sequence"]

# A step end handled later than this restarts the schedule from now; below it, the
# next steps start on schedule, so a loop that was briefly busy catches up and the
# mean step time stays the profile's.
_LATE_S = 0.025


class Engine:
    def __init__(self, profile: Profile, stats: FakeStats, manual: bool = False) -> None:
        self.profile = profile
        self.stats = stats
        self.kv = KvCache(profile.kv_blocks, profile.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self.busy_s = 0.0  # emulated time spent in steps
        self.lag_s = 0.0  # how far behind schedule the loop ran, summed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch: list[tuple[Sequence, int]] = []
        self._step_end: float | None = None  # None: idle
        self._idle_since = 0.0  # when the last step ended
        self._start_at: float | None = None  # an idle engine's next step, about to start
        # called with (stepping, emulated instant) when the engine starts or stops
        # stepping: the API server's share of a shared CPU depends on it
        self.on_busy: Callable[[bool, float], None] | None = None
        # manual: no timers; `advance()` runs the next step at once (tests, simulation)
        self._manual = manual
        # steps started from now last this many times the profile's: a simulator of
        # engines sharing too few CPU cores sets it (bench.studies.qos.sim)
        self.slowdown = 1.0
        self.now = 0.0

    # -- requests ---------------------------------------------------------------

    def add(self, seq: Sequence, at: float | None = None) -> None:
        """Queue a request; `at`: the emulated instant it arrived, if the loop hands it
        over late (an idle engine starts its step then, not after the loop's delay).

        An idle engine starts its step once the loop has handed over everything that
        arrived at the same instant, as vLLM's engine takes every queued request before
        it schedules: requests released together by the API server share a step (started
        at the first's `add`, a wave of 8 went 1 + 7)."""
        self.waiting.append(seq)
        self.stats.waiting = len(self.waiting)
        if self._step_end is None and self._start_at is None:
            now = self._now()
            self._start_at = now if at is None else max(min(at, now), self._idle_since)
            if self._manual:
                self._start_pending()
            else:
                assert self._loop is not None
                self._loop.call_soon(self._start_pending)

    def add_all(self, seqs: list[Sequence]) -> None:
        """Requests arriving together (manual mode: `add` starts a step at once)."""
        self.waiting.extend(seqs[:-1])
        self.add(seqs[-1])

    def _start_pending(self) -> None:
        start, self._start_at = self._start_at, None
        if start is not None and self._step_end is None:
            self._start_step(start)

    def abort(self, seq: Sequence) -> None:
        """Drop a request (client gone): its slot and KV blocks are free at once."""
        if seq.done:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq)
        self._publish()

    # -- scheduling -------------------------------------------------------------

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (request, tokens to compute) pairs."""
        budget = self.profile.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.length - seq.computed, budget)
            while not self._grow(seq, seq.computed + count):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, count))
                budget -= count
                index += 1
                continue
            break
        if not preempted:
            budget = self._admit(batch, budget)
        self._publish()
        return batch

    def _admit(self, batch: list[tuple[Sequence, int]], budget: int) -> int:
        profile, kv = self.profile, self.kv
        while self.waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            seq = self.waiting[0]
            # vLLM computes at least the last token, so it never counts it as a hit
            names = seq.block_names(seq.length - 1, profile.block_size)
            cached = names[:kv.match(names)]
            start = len(cached) * profile.block_size
            count = min(seq.length - start, budget)
            fresh = kv.blocks_for(start + count) - len(cached)
            if not kv.can_hold(fresh, cached):
                break
            kv.hold(cached)
            kv.allocate(fresh)
            seq.hashes, seq.held, seq.plain = cached, list(cached), fresh
            seq.computed = start
            if seq.preemptions == 0:
                self.stats.prefix_queries += len(seq.prompt_ids)
                self.stats.prefix_hits += start
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, count))
            budget -= count
        return budget

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        fresh = self.kv.blocks_for(tokens) - seq.blocks
        if fresh <= 0:
            return True
        if not self.kv.can_hold(fresh):
            return False
        self.kv.allocate(fresh)
        seq.plain += fresh
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    # -- steps --------------------------------------------------------------------

    def _now(self) -> float:
        if self._manual:
            return self.now
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def _start_step(self, start: float) -> None:
        batch = self.schedule()
        if not batch and self.waiting:  # everything was preempted: admit now
            batch = self.schedule()
        if not batch:
            self._step_end = None
            self._idle_since = start
            if self.on_busy is not None:
                self.on_busy(False, start)
            return
        if self._step_end is None and self.on_busy is not None:
            self.on_busy(True, start)
        self._batch = batch
        duration = self.step_seconds(batch) * self.slowdown
        self.busy_s += duration
        self._step_end = start + duration
        if not self._manual:
            assert self._loop is not None
            self._loop.call_at(self._step_end, self._on_step_end)

    def advance(self) -> bool:
        """Manual mode: run the step in flight to its end; False when idle."""
        if self._step_end is None:
            return False
        self.now = end = self._step_end
        self.complete_step(end)
        self._start_step(end)
        return True

    def step_seconds(self, batch: list[tuple[Sequence, int]]) -> float:
        step = self.profile.step
        tokens = context = pairs = 0
        for seq, count in batch:
            tokens += count
            context += step.read_context(seq.computed + count)
            pairs += count * seq.computed + count * (count + 1) // 2
        return step.seconds(tokens, len(batch), context, pairs)

    def _on_step_end(self) -> None:
        now = self._now()
        end = self._step_end
        assert end is not None
        self.complete_step(end)  # metrics in emulated time, free of loop jitter
        late = now - end
        if late > _LATE_S:
            self.lag_s += late
        self._start_step(end if late <= _LATE_S else now)

    def complete_step(self, now: float) -> None:
        """Apply the batch that just ran: KV computed, one token per finished prefill."""
        self.steps += 1
        stats = self.stats
        for seq, count in self._batch:
            if seq.done:  # aborted during the step
                continue
            seq.computed += count
            self._name_full_blocks(seq)
            if seq.computed < seq.length:
                continue  # a prefill chunk that does not reach the end yet
            if seq.output == 0:
                stats.prompt_tokens += len(seq.prompt_ids)
                stats.ttft.observe(now - seq.arrival)
            else:
                stats.itl.observe(now - seq.last_token_at)
            seq.output += 1
            seq.last_token_at = now
            stats.generation_tokens += 1
            if seq.output >= seq.max_tokens:
                self.running.remove(seq)
                self._finish(seq)
                stats.finished += 1
            seq.wake()
        self._batch = []
        self._publish()

    def _name_full_blocks(self, seq: Sequence) -> None:
        size = self.profile.block_size
        full = seq.computed // size
        parent = seq.hashes[-1] if seq.hashes else 0
        for index in range(len(seq.hashes), full):
            parent = block_hash(parent, seq.token_ids(index * size, (index + 1) * size))
            seq.hashes.append(parent)
            if self.kv.adopt(parent):
                seq.held.append(parent)
                seq.plain -= 1

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq.held, seq.plain)
        seq.hashes, seq.held, seq.plain = [], [], 0

    def _finish(self, seq: Sequence) -> None:
        self._release(seq)
        seq.done = True
        seq.wake()

    def _publish(self) -> None:
        stats = self.stats
        stats.running = len(self.running)
        stats.waiting = len(self.waiting)
        stats.kv_tokens = self.kv.used_blocks * self.profile.block_size
