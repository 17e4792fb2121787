"""GoodServe (`goodserve.txt`): just-enough selection for end-to-end SLOs, plus the
periodic SLO-risk check that moves a stream to a faster backend.

Algorithm 1, per request r with deadline D_r, for every candidate g:

    T(r, g) = q_g + p_g * (L_in - H_rg) + d_g * L_out                       (Eq. 2)

Feasible backends are those with T <= D_r; among them the one with the *largest* d_g
(the slowest that still meets the SLO) is chosen, leaving faster backends to more
urgent requests; if none is feasible, argmin (T - D_r). q/p/d come from the EMA
speed model (`policies/goodput/speed.py`), L_out from the length predictor (or `max_tokens`
as an oracle in benchmarks), H_rg from the proxy's own prefix index.

Every τ generated tokens the proxy asks `reroute`: the remaining length and the
current speed are re-estimated; if the expected finish exceeds D_r, the stream moves
(token-ID migration) to the just-enough backend among the *faster* ones.

Deviations, all configurable: requests without an SLO fall back to least in-flight
(the paper: "follow the conventional routing methods"); L_in is estimated from the
prompt's characters (`chars_per_token`); at each check the proxy re-runs the
length predictor over the answer so far (`Runtime.predict_window`, as the paper does),
and if a stream has still outrun that estimate (or no predictor is loaded) its
remaining length is taken as `overrun_fraction` * generated; a move must win at least
`min_gain_s` over staying. `rescue_only` (off by default: the paper's rule) moves a
stream only when the move meets D_r; the paper's rule also moves streams that will
miss D_r either way, to the least-overrun faster backend, which re-prefills their
prompt + answer on the target (0.1-0.4 s on vLLM-CPU; negligible on the paper's
GPUs). Measured side by side (docs/goodput.md) the two rules are within run-to-run
noise, the paper's ahead more often, so it stays the default.

At the τ check the stream's expected speed where it runs is, by default, its own mean
TPOT on that backend so far; `risk_speed: estimate` takes the backend's EMA d_g instead
(§3.4 re-estimates "the GPU processing speed with the methods in Sec. 3.3"); either is
also the bar a target's d_g must beat to count as faster.

`selection: capability` (off by default) reads §3.4's "the instance with the worst
computing capability" as hardware rather than current TPOT: among the feasible
backends it keeps those whose lightly loaded d_g (`SpeedModel.capability`) is within
`tier_tolerance` of the slowest such, and sends the request to the one with the fewest
requests in flight. Algorithm 1's largest current d_g is, among backends of one GPU
type, the most loaded one, so a burst piles onto a single slow instance until the
lagging EMA sees it; on a lightly loaded fleet that costs SLOs the load balancers meet
(docs/goodput.md).

`speed_at_load` (off by default) prices a request at the speed of the batch it would
join: d_g in Eq. 2 becomes the backend's TPOT at (its requests in flight + 1), from a
line fitted to its snapshots' (running requests, TPOT) pairs (`SpeedModel.tpot_at`;
the EMA d_g until the fit has `load_min_samples` snapshots). Algorithm 1 prices it at
the EMA of recent samples, which lags a burst: every request of the burst is feasible
on the same slow backend until its samples catch up.

`protect` (off by default) also prices what an admission does to the requests already
on a backend. Eq. 2 only asks whether r meets D_r on g; admitting r slows every stream
on g (its prefill stalls their decode steps for p_g * (L_in - H_rg), and one more
request in the batch raises d_g by the load fit's slope), so at loose scales, where
many requests are feasible on the slowest backends, Algorithm 1 keeps admitting onto
them until the ones already there miss. With `protect`, g is feasible for r only if
no request on g that is on track (its expected finish, at g's current d, within its
deadline) would be pushed past it; the selection rule is then applied to those
backends, a request no backend can take in time goes to the least overrun among the
backends it harms nobody on (Algorithm 1's fallback, restricted), and only if every
backend would be harmed to the least overrun of all. τ-check moves are checked the
same way; with `harmful_moves: false` a stream every faster backend would be harmed by
stays where it is instead (an arrival has to go somewhere, a move does not); on four
heavily loaded GPUs that kept the H100 at the load it still serves within SLO and
lifted scale 1 from 0.95-1.09x to 1.47x the best baseline in two runs (docs/goodput.md:
No harmful moves). The requests on g are the ones this policy routed there
with a deadline (`policies/goodput/placements.py`), their generated tokens counted at each τ
check and extrapolated at d between checks.

`length_quantile` (off by default) routes on a calibrated length instead of the point
prediction: L_out in Eq. 2 becomes that quantile of the true lengths of the recent
requests whose prediction fell in the same (log2) bucket, learned online from the
requests this policy routed and saw finish (`predictors/length/calibration.py`; a bucket with
fewer than `calibration_min_samples` keeps the prediction). An under-estimated request
is what Algorithm 1 sends to the slowest backend where it then misses; the quantile
asks each backend to meet D_r for a length the request stays under with that
probability. With `calibrate_checks` the τ check reads the same samples: a stream's
remaining length is the quantile of how much further the bucket's requests that ran
past its tokens so far went (the overrun rule and the window re-prediction otherwise).
Where no backend meets D_r for the calibrated length (at tight SLO scales, most
requests), Algorithm 1's fallback sends the request to the least overrun, the fastest
backend, and every such request lands there; `quantile_fallback: prediction` then
runs Algorithm 1 on the point prediction instead, if some backend meets D_r for that
(the quantile a margin where one fits, not a veto).
With `calibration_prior` (on by default; a deviation, as the rest of this paragraph)
a replica does not start blind: when the length artifact was trained with
`--calibration-folds`, each prediction carries its out-of-fold (predicted, true)
lengths of the training prompts (`predictors.base.LengthPrior`), and the first
request of each predictor key records them as if they had finished here; the
replica's own outcomes then replace them in each bucket's window.

`infeasible: least_loaded` (off by default) changes that fallback for every request no
backend meets D_r for: it goes to the backend with the fewest requests in flight
(ties: the least overrun) rather than the least overrun; a τ-check move none of the
faster backends meets D_r for likewise. Such a request cannot add
goodput (the paper's §6 would rather drop it; laneway never drops), while under
Algorithm 1 every one of them lands on the fastest backend and slows the requests
there that can still make it: on four heavily loaded GPUs at SLO scale 1 only the
H100 meets any SLO, and Algorithm 1 held twice the requests there that least_request
did (peak 74 in flight against 37), meeting half of them against all. Measured, it
does not pay (docs/goodput.md: "The repeat, and the deviations combined"): the H100's
first placements then all meet their SLOs, but fewer go there and the τ checks move
the hopeless streams to it anyway; nor with `speed_at_load` beside it (docs/goodput.md).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, Field

from policies.base import PARAMS_CONFIG, register
from policies.goodput.placements import Placed, Placements
from policies.goodput.speed import Floats, Speed, SpeedModel
from policies.load_helpers import LeastInflight, inflight_loads
from policies.prefix_index import PrefixIndex, blocks_from_wire, blocks_to_wire
from predictors.length.calibration import LengthCalibration
from proxy.types import (
    Backend,
    ClusterView,
    Decision,
    Outcome,
    Prediction,
    Progress,
    RequestContext,
)

log = logging.getLogger("laneway")

MAX_WINDOWS = 100_000  # running streams remembered for window samples

Estimate = tuple[Backend, float, float]  # (g, T(r, g), d_g)


@dataclass(frozen=True, slots=True)
class Estimates:
    """Eq. 2 for every candidate: T(r, g), d_g and L_in - H_rg (the prompt tokens g has
    to prefill) in the order of `backends`. Indexing and iterating give (g, T, d) rows;
    `where` and `without` give subsets."""

    backends: tuple[Backend, ...]
    total: Floats
    tpot: Floats
    prefill: Floats

    def __len__(self) -> int:
        return len(self.backends)

    def __getitem__(self, i: int) -> Estimate:
        return self.backends[i], float(self.total[i]), float(self.tpot[i])

    def __iter__(self) -> Iterator[Estimate]:
        return zip(self.backends, self.total.tolist(), self.tpot.tolist(), strict=True)

    def where(self, keep: npt.NDArray[np.bool_]) -> Estimates:
        return Estimates(tuple(b for b, k in zip(self.backends, keep.tolist(), strict=True)
                               if k), self.total[keep], self.tpot[keep], self.prefill[keep])

    def without(self, backend: Backend) -> Estimates:
        return self.where(np.array([b is not backend for b in self.backends]))

    def of(self, backend: Backend) -> float:
        """T(r, g) of `backend`."""
        return float(self.total[self.backends.index(backend)])

    def prefill_of(self, backend: Backend) -> float:
        """L_in - H_rg of `backend`."""
        return float(self.prefill[self.backends.index(backend)])


class GoodputParams(BaseModel):
    model_config = PARAMS_CONFIG
    alpha: float = Field(0.3, gt=0, le=1, description="EMA weight of the newest sample")
    length_source: Literal["predictor", "hint", "max_tokens"] = Field(
        "predictor", description="L_out: the length predictor; hint: the client's "
        "x-laneway-expected-tokens header, else the predictor; max_tokens (oracle when "
        "max_tokens is the true length)")
    default_output_tokens: int = Field(256, gt=0, description="L_out with no prediction")
    default_slo_s: dict[str, float] = Field(
        default_factory=dict, description="D_r per model when no x-laneway-slo-ms header")
    chars_per_token: float = Field(4.0, gt=0, description="L_in estimate from prompt chars")
    block_chars: int = Field(128, gt=0, description="= server.prefix_block_chars")
    prefix_entries: int = Field(100_000, gt=0, description="prefix blocks remembered")
    migrate: bool = Field(True, description="rectify at runtime (move at-risk streams)")
    overrun_fraction: float = Field(0.25, gt=0, description="remaining/generated once "
                                    "a stream outran its predicted length")
    min_gain_s: float = Field(0.0, ge=0, description="a move must finish this much sooner")
    rescue_only: bool = Field(False, description="move only when the move meets D_r "
                              "(default: the paper's rule, also least-overrun moves)")
    handoff_s: float = Field(0.05, ge=0, description="cost of a move, added to its T")
    default_queue_s: float = Field(0.0, ge=0, description="q_g before any observation")
    default_prefill_s_per_token: float = Field(0.0005, ge=0)
    default_tpot_s: float = Field(0.03, gt=0, description="d_g before any observation")
    stream_samples: bool = Field(True, description="every τ-token check of a running "
                                 "stream is a d_g sample too (the TPOT of its last window)")
    selection: Literal["paper", "capability"] = Field(
        "paper", description="among feasible backends: the largest current d_g "
        "(Algorithm 1), or the slowest hardware tier, least in flight within it")
    tier_tolerance: float = Field(0.2, ge=0, description="selection capability: backends "
                                  "within this fraction of the slowest capability form its tier")
    headroom: float = Field(0.0, ge=0, lt=1, description="routing only: a backend is "
                            "feasible when T(r,g) <= (1 - headroom) x D_r (Algorithm 1: 0)")
    risk_speed: Literal["stream", "estimate"] = Field(
        "stream", description="the τ check's speed for a stream where it runs: its own "
        "TPOT on that backend so far, or the backend's EMA d_g (§3.4's 'methods in Sec. 3.3')")
    speed_at_load: bool = Field(False, description="d_g in Eq. 2 at the backend's "
                                "in-flight requests + 1, from a fit of its TPOT against its "
                                "running requests (Algorithm 1: the EMA d_g as it stands)")
    load_fit_alpha: float = Field(0.05, gt=0, le=1, description="speed_at_load: EMA weight "
                                  "of the newest snapshot in the fit")
    load_min_samples: int = Field(10, ge=2, description="speed_at_load: snapshots with a "
                                  "TPOT before the fit is used")
    protect: bool = Field(False, description="a backend is feasible only if admitting the "
                          "request pushes no on-track request already there past its "
                          "deadline (Algorithm 1: not checked)")
    length_quantile: float | None = Field(None, gt=0, lt=1, description="routing's L_out "
                                          "is this quantile of the true lengths of recent "
                                          "requests predicted alike (None: the "
                                          "prediction, Algorithm 1)")
    calibrate_checks: bool = Field(False, description="length_quantile at the τ check too: "
                                   "a stream's remaining length is the quantile of how much "
                                   "further its bucket's requests that ran as far went")
    quantile_fallback: Literal["overrun", "prediction"] = Field(
        "overrun", description="length_quantile, when no backend meets D_r for the "
        "calibrated length: the least overrun at it (overrun), or Algorithm 1 on the "
        "point prediction if some backend meets D_r for that (prediction)")
    infeasible: Literal["overrun", "least_loaded"] = Field(
        "overrun", description="a request no backend meets D_r for: the least overrun "
        "(Algorithm 1: argmin T - D_r, in practice the fastest backend), or the backend "
        "with the fewest requests in flight (least_loaded: it cannot add goodput, so it "
        "goes where it delays the fewest others)")
    harmful_moves: bool = Field(True, description="protect: a τ-check move every faster "
                                "backend would harm a request on still goes to the least "
                                "overrun of them, as an arrival does (true), or the stream "
                                "stays where it is (false: a move is optional)")
    calibration_window: int = Field(500, gt=0, description="length_quantile: finished "
                                    "requests remembered per prediction bucket")
    calibration_prior: bool = Field(True, description="length_quantile: start each "
                                    "bucket from the length artifact's out-of-fold (predicted, "
                                    "true) lengths, when it has them (false: from nothing)")
    calibration_min_samples: int = Field(50, gt=0, description="length_quantile: a bucket "
                                         "routes on the prediction until it has this many")


@register
class Goodput:
    name: ClassVar[str] = "goodput"
    Params: ClassVar[type[BaseModel]] = GoodputParams

    def __init__(self, params: GoodputParams) -> None:
        self._p = params
        self._speeds = SpeedModel(params.alpha, Speed(
            params.default_queue_s, params.default_prefill_s_per_token, params.default_tpot_s),
            params.load_fit_alpha if params.speed_at_load or params.protect else None,
            params.load_min_samples)
        self._prefixes = PrefixIndex(params.prefix_entries)
        self._least = LeastInflight()
        # running streams' last check: request id -> (backend, generated, elapsed_s)
        self._windows: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._placed = Placements(MAX_WINDOWS)  # protect: deadlines on each backend
        self._outbox: deque[list[Any]] | None = None  # prefix writes to replicate
        self._calibration = (None if params.length_quantile is None else LengthCalibration(
            params.length_quantile, params.calibration_window, params.calibration_min_samples))
        self._predicted: OrderedDict[str, float] = OrderedDict()  # request id -> L_out

    # -- Algorithm 1 -------------------------------------------------------------
    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        deadline = self._deadline(ctx)
        if deadline is None:
            backend, load = self._least.pick(view)
            return self._chosen(ctx, backend, f"no SLO: least in-flight ({load})")
        output_tokens = self._routing_length(ctx, pred)
        times = self.estimates(ctx, output_tokens, view)
        budget = deadline * (1 - self._p.headroom)
        times, output_tokens, note = self._calibrated(ctx, times, output_tokens, budget, view)
        backend, reason = self._choose(ctx, times, budget, view)
        if self._p.headroom:  # the D in the reason is the budget: say of which deadline
            reason += f" (headroom {self._p.headroom:.0%} of D_r={deadline:.3f}s)"
        reason += note
        if self._p.protect:
            self._place(ctx, backend, ctx.arrived_at + deadline, output_tokens,
                        times.prefill_of(backend), view)
        return self._chosen(ctx, backend, reason)

    def _calibrated(self, ctx: RequestContext, times: Estimates, output_tokens: float,
                    budget: float, view: ClusterView) -> tuple[Estimates, float, str]:
        """With `length_quantile`: the estimates to route on, their L_out and what the
        reason says of it; `quantile_fallback: prediction` swaps in the point
        prediction's estimates when no backend meets the budget at the calibrated
        length but some does at the prediction."""
        predicted = self._predicted.get(ctx.request_id)
        if predicted is None or predicted == output_tokens:
            return times, output_tokens, ""  # Algorithm 1's L_out
        quantile = f"the q{self._p.length_quantile:g} of requests predicted like its"
        if (self._p.quantile_fallback == "prediction" and predicted < output_tokens
                and not np.any(times.total <= budget)):
            point = self.estimates(ctx, predicted, view)
            if np.any(point.total <= budget):  # Algorithm 1 on the prediction
                return point, predicted, (
                    f" (L_out {predicted:.0f}, the prediction: no backend meets D for "
                    f"{output_tokens:.0f}, {quantile} {predicted:.0f})")
        return times, output_tokens, f" (L_out {output_tokens:.0f}: {quantile} {predicted:.0f})"

    def estimates(self, ctx: RequestContext, output_tokens: float, view: ClusterView,
                  done_tokens: int = 0) -> Estimates:
        """T(r, g) and d_g for every candidate: Eq. 2, as array operations over the
        speed model's columns (at 512 backends this is the decision)."""
        prompt_tokens, hits = self._prompt(ctx, done_tokens)
        cols, queue, prefill_rate, tpot = self._speeds.columns(view.candidates, view.stats)
        prefill = np.full(len(queue), prompt_tokens)
        for name in hits:  # the few backends holding a prefix of the prompt
            i = cols.position(name)
            if i is not None:
                prefill[i] = self._uncached(prompt_tokens, hits, name)
        if self._p.speed_at_load:
            fitted = [self._speeds.tpot_at(b.name, view.inflight_of(b) + 1)
                      for b in view.candidates]
            tpot = np.array([d if f is None else f
                             for d, f in zip(tpot.tolist(), fitted, strict=True)])
        return Estimates(view.candidates, queue + prefill_rate * prefill
                         + tpot * output_tokens, tpot, prefill)

    @staticmethod
    def just_enough(times: Estimates, meets: npt.NDArray[np.bool_], deadline: float
                    ) -> tuple[Backend, str]:
        """Algorithm 1's choice among the backends that meet D_r (`meets`, not all
        false): the slowest, the largest d_g."""
        backend, total, tpot = times[int(np.argmax(np.where(meets, times.tpot, -np.inf)))]
        return backend, (f"just enough: T={total:.3f}s <= D={deadline:.3f}s with the "
                         f"slowest feasible d={tpot * 1000:.1f}ms "
                         f"({int(np.count_nonzero(meets))} feasible)")

    @staticmethod
    def least_overrun(times: Estimates, deadline: float) -> tuple[Backend, str]:
        """Algorithm 1's fallback when no backend meets D_r: argmin (T - D_r)."""
        backend, total, _ = times[int(np.argmin(times.total - deadline))]
        return backend, f"none feasible: least overrun T={total:.3f}s > D={deadline:.3f}s"

    def _infeasible(self, times: Estimates, deadline: float, view: ClusterView
                    ) -> tuple[Backend, str]:
        """Where a request no candidate meets D_r for goes (`infeasible`)."""
        if self._p.infeasible == "overrun":
            return self.least_overrun(times, deadline)
        loads = np.array(inflight_loads(view, [b.name for b in times.backends]))
        i = int(np.lexsort((times.total, loads))[0])
        backend, total, _ = times[i]
        return backend, (f"none feasible: least loaded ({loads[i]} in flight), "
                         f"T={total:.3f}s > D={deadline:.3f}s")

    def _select(self, times: Estimates, deadline: float, view: ClusterView
                ) -> tuple[Backend, str]:
        meets = times.total <= deadline
        if not meets.any():
            return self._infeasible(times, deadline, view)
        if self._p.selection == "paper":
            return self.just_enough(times, meets, deadline)
        feasible = times.where(meets)
        caps = [self._capability(t) for t in feasible]
        floor = max(caps) / (1 + self._p.tier_tolerance)
        tier = [t for t, cap in zip(feasible, caps, strict=True) if cap >= floor]
        backend, total, _ = min(tier, key=lambda t: (view.inflight_of(t[0]), -t[2]))
        return backend, (f"just enough (capability): T={total:.3f}s <= D={deadline:.3f}s, "
                         f"slowest tier d>={floor * 1000:.1f}ms ({len(tier)} of "
                         f"{len(feasible)} feasible), {view.inflight_of(backend)} in flight")

    def _choose(self, ctx: RequestContext, times: Estimates, deadline: float,
                view: ClusterView) -> tuple[Backend, str]:
        """`_select`, with `protect` over the backends r harms nobody on (`_unharmed`);
        the least overrun of all if every one is struck."""
        if not self._p.protect:
            return self._select(times, deadline, view)
        chosen, struck = self._unharmed(ctx, times, deadline, view)
        if chosen is not None:
            return chosen
        backend, reason = self._infeasible(times, deadline, view)
        return backend, reason + f" (protect: all {struck} would harm a request)"

    def _unharmed(self, ctx: RequestContext, times: Estimates, deadline: float,
                  view: ClusterView) -> tuple[tuple[Backend, str] | None, int]:
        """`_select` over the backends r harms nobody on: each pick the rule makes that
        would push an on-track request past its deadline is struck off and the rule
        applied again to the rest (so a request none meets D_r on goes to the least
        overrun among them); None if every one is struck, and how many were."""
        left = times
        struck: list[str] = []
        while left:
            backend, reason = self._select(left, deadline, view)
            harmed = self._harms(ctx, backend, view, left.prefill_of(backend))
            if harmed is None:
                return (backend, reason + (f" (protect: {len(struck)} refused, e.g. "
                                           f"{', '.join(struck[:3])})" if struck else "")
                        ), len(struck)
            struck.append(f"{backend.name} for {harmed}")
            left = left.without(backend)
        return None, len(struck)

    def _harms(self, ctx: RequestContext, backend: Backend, view: ClusterView,
               prefill_tokens: float) -> str | None:
        """The id of an on-track request on `backend` that admitting r would push past
        its deadline: r's prefill (`prefill_tokens` there) stalls its decode steps, and
        one more request in the batch raises d by the load fit's slope."""
        name = backend.name
        speed = self._speeds.of(name, view.stats_of(backend))
        running = view.inflight_of(backend)
        fitted = self._speeds.tpot_at(name, running)
        tpot = max(1e-6, speed.tpot_s if fitted is None else fitted)
        joined = self._speeds.tpot_at(name, running + 1)
        slower = 0.0 if joined is None else max(0.0, joined - tpot)
        stall = speed.prefill_s_per_token * prefill_tokens
        now = view.now
        for placed in self._placed.on(name):
            if placed.request_id == ctx.request_id:
                continue
            generated = placed.generated + max(0.0, now - placed.counted_at) / tpot
            left = self._tokens_left(placed.output_tokens, generated, placed.max_tokens)
            margin = placed.deadline_at - now - left * tpot
            if 0 <= margin < left * slower + stall:
                return placed.request_id
        return None

    def _prompt(self, ctx: RequestContext, done_tokens: int) -> tuple[float, dict[str, int]]:
        """L_in (+ tokens already generated, for a move) and the prefix blocks each
        backend already got (H_rg, in blocks)."""
        hits = self._prefixes.matched_blocks(ctx.prompt_blocks) if ctx.prompt_blocks else {}
        return len(ctx.prompt_text) / self._p.chars_per_token + done_tokens, hits

    def _uncached(self, prompt_tokens: float, hits: dict[str, int], name: str) -> float:
        """L_in - H_rg: the prompt tokens `name` has to prefill."""
        p = self._p
        return max(0.0, prompt_tokens - hits.get(name, 0) * p.block_chars / p.chars_per_token)

    def _place(self, ctx: RequestContext, backend: Backend, deadline_at: float,
               output_tokens: float, prefill_tokens: float, view: ClusterView) -> None:
        speed = self._speeds.of(backend.name, view.stats_of(backend))
        decode_from = view.now + speed.queue_s + speed.prefill_s_per_token * prefill_tokens
        self._placed.place(Placed(ctx.request_id, backend.name, deadline_at, output_tokens,
                                  ctx.max_tokens, counted_at=decode_from))

    def _capability(self, time: Estimate) -> float:
        """The backend's lightly loaded d_g; its current one if it has no estimate yet."""
        cap = self._speeds.capability(time[0].name)
        return time[2] if cap is None else cap

    # -- runtime rectification ---------------------------------------------------------
    def reroute(self, ctx: RequestContext, pred: Prediction, progress: Progress,
                view: ClusterView) -> Decision | None:
        if self._p.stream_samples:
            self._observe_window(ctx.request_id, progress)
        if self._p.protect:
            self._placed.progress(ctx.request_id, progress.backend.name, progress.generated,
                                  ctx.arrived_at + progress.elapsed_s,
                                  self._output_tokens(ctx, pred))
        deadline = self._deadline(ctx)
        if not self._p.migrate or deadline is None:
            return None
        remaining = self._remaining(ctx, pred, progress)
        here = self._speeds.of(progress.backend.name, view.stats_of(progress.backend))
        tpot_here = (here.tpot_s if self._p.risk_speed == "estimate"
                     else progress.tpot_s or here.tpot_s)
        finish_here = progress.elapsed_s + tpot_here * remaining
        if finish_here <= deadline:
            return None
        times = self.estimates(ctx, remaining, view, progress.generated)
        faster = times.where(times.tpot < tpot_here)
        if not faster:
            return None
        slack = deadline - progress.elapsed_s - self._p.handoff_s
        if self._p.protect and not self._p.harmful_moves:
            chosen, _ = self._unharmed(ctx, faster, slack, view)
            if chosen is None:
                return None  # every faster backend would make an on-track request miss
            backend, reason = chosen
        else:
            backend, reason = self._choose(ctx, faster, slack, view)
        moved_finish = progress.elapsed_s + self._p.handoff_s + faster.of(backend)
        if moved_finish > finish_here - self._p.min_gain_s:
            return None
        if self._p.rescue_only and moved_finish > deadline:
            return None
        self._placed.move(ctx.request_id, backend.name)
        return self._chosen(ctx, backend, f"SLO risk: finish {finish_here:.2f}s > "
                            f"D {deadline:.2f}s here; {reason}")

    def _observe_window(self, request_id: str, progress: Progress) -> None:
        """§3.3's EMA from streaming requests too: the TPOT of the tokens since this
        stream's previous check, on the backend it ran them on (d_g then follows a
        backend's load while its streams run, not only when one finishes)."""
        name = progress.backend.name
        last = self._windows.pop(request_id, None)
        self._windows[request_id] = (name, progress.generated, progress.elapsed_s)
        while len(self._windows) > MAX_WINDOWS:  # streams whose outcome never came
            self._windows.popitem(last=False)
        if last is not None and last[0] == name and progress.generated > last[1]:
            self._speeds.observe_tpot(name, (progress.elapsed_s - last[2])
                                      / (progress.generated - last[1]))

    def _remaining(self, ctx: RequestContext, pred: Prediction, progress: Progress) -> float:
        predicted = self._predicted.get(ctx.request_id)
        if self._calibration is not None and self._p.calibrate_checks and predicted:
            left = self._calibration.remaining(predicted, progress.generated)
            if left is not None:
                return self._tokens_left(progress.generated + left, progress.generated,
                                         progress.max_tokens)
        return self._tokens_left(self._output_tokens(ctx, pred), progress.generated,
                                 progress.max_tokens)

    def _tokens_left(self, predicted: float, generated: float, max_tokens: int | None
                     ) -> float:
        """Predicted minus generated; once a stream outran its prediction,
        `overrun_fraction` x generated; never past max_tokens, never below one."""
        remaining = predicted - generated
        if remaining <= 0:
            remaining = max(1.0, self._p.overrun_fraction * generated)
        if max_tokens is not None:
            remaining = min(remaining, max_tokens - generated)
        return max(1.0, remaining)

    # -- inputs ------------------------------------------------------------------
    def _deadline(self, ctx: RequestContext) -> float | None:
        if ctx.slo_ms is not None:
            return ctx.slo_ms / 1000
        return self._p.default_slo_s.get(ctx.model)

    def _output_tokens(self, ctx: RequestContext, pred: Prediction) -> float:
        given = self._given_length(ctx)
        if given is not None:
            return given
        if pred.output_tokens is not None:
            return pred.output_tokens
        default = self._p.default_output_tokens
        return float(min(default, ctx.max_tokens or default))

    def _given_length(self, ctx: RequestContext) -> float | None:
        """L_out from the request itself (`length_source` max_tokens or hint), if so."""
        source = self._p.length_source
        if source == "max_tokens" and ctx.max_tokens is not None:
            return float(ctx.max_tokens)
        if source == "hint" and ctx.expected_tokens is not None:
            return float(min(ctx.expected_tokens, ctx.max_tokens or ctx.expected_tokens))
        return None

    def _routing_length(self, ctx: RequestContext, pred: Prediction) -> float:
        """L_out for Algorithm 1's choice: the predictor's, or with `length_quantile`
        its calibrated quantile (`predictors/length/calibration.py`), never past max_tokens."""
        tokens = self._output_tokens(ctx, pred)
        if (self._calibration is None or pred.output_tokens is None
                or self._given_length(ctx) is not None):
            return tokens  # no calibration, or L_out is not the predictor's
        if self._p.calibration_prior and pred.length_prior is not None \
                and self._calibration.prime(pred.length_prior):
            log.info("goodput: length calibration primed with %d out-of-fold answers of "
                     "predictor key %s", len(pred.length_prior.samples), pred.length_prior.key)
        self._predicted[ctx.request_id] = tokens
        while len(self._predicted) > MAX_WINDOWS:  # requests whose outcome never came
            self._predicted.popitem(last=False)
        calibrated = self._calibration.adjust(tokens)
        return min(calibrated, ctx.max_tokens) if ctx.max_tokens else calibrated

    def _chosen(self, ctx: RequestContext, backend: Backend, reason: str) -> Decision:
        self._prefixes.remember(ctx.prompt_blocks, backend.name)
        if self._outbox is not None and ctx.prompt_blocks:
            self._outbox.append(["p", backend.name, blocks_to_wire(ctx.prompt_blocks)])
        return Decision(backend, reason)

    # -- replication (proxy/state): prefix index writes and EMA speed estimates ------
    def export_updates(self) -> list[Any]:
        if self._outbox is None:
            self._outbox = deque(maxlen=10_000)
        updates = list(self._outbox)
        self._outbox.clear()
        for name in self._speeds.changed:
            speed = self._speeds.peek(name)
            if speed is not None:
                updates.append(["s", name, speed.queue_s, speed.prefill_s_per_token,
                                speed.tpot_s])
        self._speeds.changed.clear()
        return updates

    def merge_updates(self, updates: list[Any]) -> None:
        for update in updates:
            if update[0] == "p":
                self._prefixes.remember(blocks_from_wire(update[2]), update[1])
            elif update[0] == "s":
                self._speeds.blend(update[1], *update[2:5])

    def observe(self, outcome: Outcome) -> None:
        self._windows.pop(outcome.request_id, None)
        if outcome.moved_to is not None:
            self._placed.move(outcome.request_id, outcome.moved_to)
        else:
            self._placed.finish(outcome.request_id)
        predicted = (None if outcome.moved_to is not None
                     else self._predicted.pop(outcome.request_id, None))
        if (self._calibration is not None and predicted is not None
                and outcome.status in (200, 499) and outcome.completion_tokens > 0):
            # 499: the client stopped reading; the tokens it got are the length it used
            self._calibration.record(predicted, outcome.completion_tokens)
        if outcome.ok and outcome.tpot_s is not None and outcome.completion_tokens > 1:
            self._speeds.observe_tpot(outcome.backend, outcome.tpot_s)
