"""DiSCo (`disco.txt`): device-server cooperative dispatch under a cost budget, and
token-level migration to the cheaper decoder.

Backends say which side they are with the label `side: device|server` (unlabelled:
server) and may carry their own prices, labels `cost_prefill` / `cost_decode` (a
server's in $ per 1M tokens, a device's in J per token), else the params' prices.

`pick` is a table lookup: the tables (Algorithm 2's waits, Algorithm 3's threshold)
are rebuilt from the learned distributions by the proxy's background task every
`recompute_interval_s` (policies.base.Recomputing), or with that 0 (offline use) every
`recompute_every` outcomes in `observe`. A DiSCo-D decision
is the server with the device as a `Hedge` after w(l); a DiSCo-S decision is the
device, with the server as a `Hedge` at 0 for the prompts Algorithm 3 races.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel

from policies.base import register
from policies.disco.cost import Costs, Side, TokenCost, resolve
from policies.disco.distributions import (
    DeviceFit,
    DeviceLine,
    Ecdf,
    LengthWindow,
    TtftWindow,
    read_prior,
)
from policies.disco.params import DiscoParams, Price
from policies.disco.planner import (
    NO_DEVICE,
    NO_SERVER,
    LengthMass,
    RaceTable,
    WaitTable,
    device_plan,
    server_plan,
)
from policies.disco.playback import buffer_target, should_migrate
from proxy.types import (
    Backend,
    ClusterView,
    Decision,
    Hedge,
    Outcome,
    Prediction,
    Progress,
    RequestContext,
)

ABORTED = 499  # the proxy's status for a leg it cancelled (or the client left)


@register
class Disco:
    name: ClassVar[str] = "disco"
    Params: ClassVar[type[BaseModel]] = DiscoParams

    def __init__(self, params: DiscoParams) -> None:
        self._p = params
        prior = read_prior(params.ttft_prior) if params.ttft_prior else None
        self._ttft = TtftWindow(params.ttft_window, prior)
        self._lengths = LengthWindow(params.length_window)
        self._device = DeviceFit(params.device_window, DeviceLine(
            1.0 / params.device_prefill_tps, params.device_overhead_s))
        self._rng = random.Random(params.seed)
        self._profiles: dict[str, tuple[Side, TokenCost]] = {}
        self._pairs: dict[tuple[str, str], tuple[Side, Costs]] = {}
        self._since_recompute = 0
        self._mass: LengthMass | None = None
        self._ecdf = Ecdf.empty()
        self._line = self._device.line()
        self._waits: WaitTable = NO_DEVICE
        self._races: RaceTable = NO_SERVER
        self.recompute()

    # -- tables, off the request path ------------------------------------------------

    @property
    def recompute_interval_s(self) -> float:
        """The proxy's background task recomputes this often (policies.base.Recomputing)."""
        return self._p.recompute_interval_s

    def recompute(self) -> None:
        """Rebuild both tables for the configured budget from the windows."""
        self._mass = LengthMass.of(self._lengths.sorted()) if len(self._lengths) else None
        ecdf = self._ttft.ecdf()
        self._ecdf = ecdf if len(self._ttft) >= self._p.min_ttft_samples else Ecdf.empty()
        self._line = self._device.line()
        self._waits = device_plan(self._mass, self._ecdf, self._p.tail_ratio, self._p.budget)
        self._races = server_plan(self._mass, self._p.budget)

    def server_ttft(self) -> Ecdf:
        """F as the tables last saw it (empty before `min_ttft_samples`)."""
        return self._ecdf

    def wait_table(self, budget: float | None = None) -> WaitTable:
        """Algorithm 2's table for `budget` (None: the configured one)."""
        if budget is None or budget == self._p.budget:
            return self._waits
        return device_plan(self._mass, self._ecdf, self._p.tail_ratio, _clamp(budget))

    def race_table(self, budget: float | None = None) -> RaceTable:
        """Algorithm 3's table for `budget` (None: the configured one)."""
        if budget is None or budget == self._p.budget:
            return self._races
        return server_plan(self._mass, _clamp(budget))

    # -- the request path --------------------------------------------------------------

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        return self.decide(ctx, view, ctx.budget)  # (the client's x-laneway-budget)

    def decide(self, ctx: RequestContext, view: ClusterView,
               budget: float | None = None) -> Decision:
        """`pick` with a per-request budget override (e.g. from a header)."""
        devices, servers = self._split(view)
        strategy = self._p.strategy
        if strategy == "server_only" or not devices:
            return Decision(_least(servers or devices, view), "disco: server only")
        if strategy == "device_only" or not servers:
            return Decision(_least(devices, view), "disco: device only")
        device, server = _least(devices, view), _least(servers, view)
        side, _ = self._costs(device, server)
        tokens = self.prompt_tokens(ctx)
        self._lengths.add(tokens)
        share = self._p.budget if budget is None else _clamp(budget)
        if side == "device":
            delay = self._device_wait(tokens, budget, share)
            hedge = Hedge(device, delay) if math.isfinite(delay) else None
            return Decision(server, f"disco-d {strategy}: device after {delay:.3g}s",
                            hedge=hedge)
        chance = (share if strategy == "stoch"
                  else self.race_table(budget).race_share(tokens))
        raced = chance >= 1.0 or (chance > 0.0 and self._rng.random() < chance)
        return Decision(device, f"disco-s {strategy}: {'raced' if raced else 'device'}",
                        hedge=Hedge(server, 0.0) if raced else None)

    def _device_wait(self, tokens: float, budget: float | None, share: float) -> float:
        if self._p.strategy == "stoch":
            return 0.0 if self._rng.random() < share else math.inf
        return self.wait_table(budget).wait(tokens)

    def prompt_tokens(self, ctx: RequestContext) -> float:
        return len(ctx.prompt_text.split()) * self._p.tokens_per_word

    # -- feedback ----------------------------------------------------------------------

    def observe(self, outcome: Outcome) -> None:
        side = self._profiles.get(outcome.backend, ("server", None))[0]
        if side == "server":
            if outcome.ttft_s is not None:
                self._ttft.add(outcome.ttft_s)
            elif outcome.status == ABORTED:  # lost the race: its TTFT exceeds its run
                self._ttft.add(outcome.e2e_s, censored=True)
        elif outcome.ttft_s is not None and outcome.prompt_tokens:
            self._device.add(outcome.prompt_tokens, outcome.ttft_s)
        if self._p.recompute_interval_s > 0.0:  # the proxy's background task does it
            return
        self._since_recompute += 1
        if self._since_recompute >= self._p.recompute_every:
            self._since_recompute = 0
            self.recompute()

    # -- migration (Eq. 4-6) ------------------------------------------------------------

    def reroute(self, ctx: RequestContext, pred: Prediction, progress: Progress,
                view: ClusterView) -> Decision | None:
        """Move the stream to the cheaper decoder once the reader holds B tokens."""
        if self._p.strategy != "disco" or not self._p.migration:
            return None
        source_side = self._profile(progress.backend)[0]
        devices, servers = self._split(view)
        targets = servers if source_side == "device" else devices
        if not targets:
            return None
        target = _least(targets, view)
        pair = (progress.backend, target) if source_side == "device" else (target,
                                                                            progress.backend)
        _, costs = self._costs(*pair)
        target_side: Side = "server" if source_side == "device" else "device"
        expected = pred.output_tokens or ctx.max_tokens or self._p.default_output_tokens
        context = self.prompt_tokens(ctx) + progress.generated
        if not should_migrate(costs.of(source_side), costs.of(target_side),
                              expected - progress.generated, context):
            return None
        t_m = (self._ecdf.quantile(self._p.migration_quantile) if target_side == "server"
               else self._line.ttft(context))
        read_rate = self._p.read_rate if ctx.read_rate is None else ctx.read_rate
        if _buffered(progress, read_rate) < buffer_target(read_rate, t_m):
            return None
        return Decision(target, f"disco: migrate to the cheaper decoder (t_m {t_m:.3g}s)")

    # -- backends ----------------------------------------------------------------------

    def check_fleet(self, labels: Sequence[Mapping[str, str]]) -> str | None:
        """Both sides labelled (one for the one-sided baselines), and no other side."""
        for at, backend in enumerate(labels):
            if backend.get("side", "server") not in ("device", "server"):
                return (f"backends[{at}].labels.side: {backend['side']!r} is neither "
                        "`device` nor `server`")
        sides = [backend.get("side") for backend in labels]
        needed = {"server_only": ("server",), "device_only": ("device",)}.get(
            self._p.strategy, ("device", "server"))
        missing = [side for side in needed if side not in sides]
        if not missing:
            return None
        return (f"backends[].labels.side: the disco policy (strategy {self._p.strategy}) "
                f"needs at least one backend labelled "
                f"{' and one '.join(f'`side: {side}`' for side in needed)}; none is "
                f"labelled {' or '.join(f'`side: {side}`' for side in missing)}")

    def _split(self, view: ClusterView) -> tuple[list[Backend], list[Backend]]:
        devices: list[Backend] = []
        servers: list[Backend] = []
        for backend in view.candidates:
            (devices if self._profile(backend)[0] == "device" else servers).append(backend)
        return devices, servers

    def _profile(self, backend: Backend) -> tuple[Side, TokenCost]:
        """Its side and its own prices (labels, else the params'), cached by name."""
        known = self._profiles.get(backend.name)
        if known is None:
            side: Side = "device" if backend.labels.get("side") == "device" else "server"
            default = self._p.device_cost if side == "device" else self._p.server_cost
            known = self._profiles[backend.name] = (side, _label_price(backend, default))
        return known

    def _costs(self, device: Backend, server: Backend) -> tuple[Side, Costs]:
        """Algorithm 1 on this pair, in one unit ($ per 1M tokens), cached."""
        key = (device.name, server.name)
        cached = self._pairs.get(key)
        if cached is None:
            cached = self._pairs[key] = resolve(
                self._p.mode, self._profile(server)[1], self._profile(device)[1],
                self._p.exchange_rate)
        return cached


def _label_price(backend: Backend, default: Price) -> TokenCost:
    try:
        prefill = float(backend.labels.get("cost_prefill", default.prefill))
        decode = float(backend.labels.get("cost_decode", default.decode))
    except ValueError:
        prefill, decode = default.prefill, default.decode
    if not all(math.isfinite(v) and v >= 0.0 for v in (prefill, decode)):
        prefill, decode = default.prefill, default.decode
    return TokenCost(prefill, decode)


def _least(backends: list[Backend], view: ClusterView) -> Backend:
    return min(backends, key=view.inflight_of)


def _clamp(budget: float) -> float:
    return min(1.0, max(0.0, budget)) if math.isfinite(budget) else 0.0


def _buffered(progress: Progress, read_rate: float) -> float:
    """Tokens the reader holds unread, if they started at the first token and kept
    their pace (tokens arrive faster than they read: the premise of §4.3)."""
    if read_rate <= 0.0 or progress.ttft_s is None:
        return 0.0
    reading = max(0.0, progress.elapsed_s - progress.ttft_s)
    read = min(progress.generated, 1 + math.floor(reading * read_rate))
    return float(progress.generated - read)
