"""DiSCo's unified cost (Eq. 8) and which side the budget constrains (Algorithm 1).

Units: a server's prices are $ per 1M tokens (as vendors quote them, the paper's
Table 8); a device's energy is J per token; the exchange rate λ is $ per MJ, so that
λ·(J per token) is again $ per 1M tokens and both sides compare in one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Side = Literal["device", "server"]
Mode = Literal["auto", "device", "server"]

# The paper's two exchange rates (Appendix E): 0.3 for its server-constrained runs,
# 5 for its device-constrained runs.
SERVER_CONSTRAINED_RATE = 0.3
DEVICE_CONSTRAINED_RATE = 5.0


@dataclass(frozen=True, slots=True)
class TokenCost:
    """Cost of one prefill (prompt) token and one decode (generated) token."""

    prefill: float
    decode: float


@dataclass(frozen=True, slots=True)
class Costs:
    """Both sides in $ per 1M tokens: the device's J/token already times λ."""

    server: TokenCost
    device: TokenCost

    def of(self, side: Side) -> TokenCost:
        return self.server if side == "server" else self.device


def unified(server: TokenCost, device_joules: TokenCost, exchange_rate: float) -> Costs:
    """Server $/1M tokens and device J/token in one unit ($/1M tokens), Eq. 8's λ."""
    device = TokenCost(exchange_rate * device_joules.prefill,
                       exchange_rate * device_joules.decode)
    return Costs(server, device)


def request_cost(costs: Costs, prefill: dict[Side, float], decode: dict[Side, float]) -> float:
    """Eq. 8 for one request: tokens prefilled and decoded on each side, in $."""
    total = 0.0
    for side in ("server", "device"):
        rate = costs.of(side)
        total += rate.prefill * prefill.get(side, 0.0) + rate.decode * decode.get(side, 0.0)
    return total / 1e6


def constrained_side(costs: Costs) -> Side:
    """Algorithm 1: the device is constrained when its cheapest token costs more than the
    server's dearest; otherwise the server is."""
    device = min(costs.device.prefill, costs.device.decode)
    server = max(costs.server.prefill, costs.server.decode)
    return "device" if device > server else "server"


def resolve(mode: Mode, server: TokenCost, device_joules: TokenCost,
            exchange_rate: float | None) -> tuple[Side, Costs]:
    """The constrained side and the unified costs.

    λ unset: the paper's rate for the side (5 device-constrained, 0.3 server). Under
    `auto` that is circular (λ decides the side), so the device-constrained rate is
    tried first and kept if Algorithm 1 agrees under it, as Algorithm 1 tests the
    device branch first; otherwise the server-constrained rate."""
    if exchange_rate is not None:
        costs = unified(server, device_joules, exchange_rate)
        return (constrained_side(costs) if mode == "auto" else mode), costs
    if mode != "auto":
        rate = DEVICE_CONSTRAINED_RATE if mode == "device" else SERVER_CONSTRAINED_RATE
        return mode, unified(server, device_joules, rate)
    costs = unified(server, device_joules, DEVICE_CONSTRAINED_RATE)
    if constrained_side(costs) == "device":
        return "device", costs
    costs = unified(server, device_joules, SERVER_CONSTRAINED_RATE)
    return constrained_side(costs), costs
