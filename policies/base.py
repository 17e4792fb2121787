"""The routing-policy protocol and its registry.

A policy is a synchronous, I/O-free function of (request, prediction, cluster view)
to a `Decision`. It may keep its own small state (a round-robin cursor, a prefix
index) but never blocks the event loop. Each policy module registers itself in
`POLICIES` with `@register`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from proxy.types import (
    ClusterView,
    Decision,
    Outcome,
    Prediction,
    Progress,
    RequestContext,
    StageSpec,
)

# Every policy's params model: unknown keys are rejected, and so are numbers that are
# not finite (pydantic reads "inf" and "nan" as floats; as a speed, a rate or a length
# they make the policy's sums NaN, and it would route on noise).
PARAMS_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NoParams(BaseModel):
    """Parameters of a policy that takes none; unknown keys are rejected."""

    model_config = PARAMS_CONFIG


class Policy(Protocol):
    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        """Choose one of `view.candidates` (never empty when called)."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Feedback on a pick: called exactly once per `pick`, also for an attempt
        that failed (then `outcome.ok` is False) so a policy can release what it
        reserved; a decision with a `hedge` is observed once per leg that started
        (the race's loser as status 499 with no TTFT). May be a no-op."""
        ...


class Rerouting(Protocol):
    """A policy that may move a running stream (checked every τ generated tokens)."""

    def reroute(
        self, ctx: RequestContext, pred: Prediction, progress: Progress, view: ClusterView
    ) -> Decision | None:
        """Another backend from `view.candidates` to continue on, or None to stay.

        `view` excludes the current backend. A returned decision is observed like a
        pick (exactly one `observe` follows it)."""
        ...


@runtime_checkable
class Staged(Protocol):
    """A policy that needs asynchronous work before its pick: it declares the stages as
    data (proxy/types.py: `StageSpec`); the proxy builds and runs them."""

    def stages(self) -> tuple[StageSpec, ...]:
        """The stages every request runs before `pick`, in order; () for none."""
        ...


@runtime_checkable
class Replicated(Protocol):
    """A policy whose learned state (prefix index, speed estimates) replicas share.

    Both calls are synchronous and cheap; the proxy's replicator moves the values
    through the state store (proxy/state) in the background."""

    def export_updates(self) -> list[Any]:
        """JSON-able writes made since the last call (the first call starts recording)."""
        ...

    def merge_updates(self, updates: list[Any]) -> None:
        """Apply writes another replica exported (they are not exported again)."""
        ...


@runtime_checkable
class Recomputing(Protocol):
    """A policy with tables rebuilt from what it learned (DiSCo's wait and race
    tables): the proxy calls `recompute` from a background task every
    `recompute_interval_s` seconds, off the request path (0: never; the policy keeps
    its own schedule)."""

    @property
    def recompute_interval_s(self) -> float: ...

    def recompute(self) -> None:
        """Rebuild the tables (synchronous, milliseconds at most)."""
        ...


@runtime_checkable
class FleetChecked(Protocol):
    """A policy that needs certain backends (DiSCo: one on each side); the config check
    (`laneway check-config`, a reload) refuses a fleet it cannot route."""

    def check_fleet(self, labels: Sequence[Mapping[str, str]]) -> str | None:
        """What is wrong with backends of these labels (one mapping per backend, in
        config order), naming the config key; None when they do."""
        ...


PolicyFactory = Callable[[Any], Policy]
POLICIES: dict[str, type[Any]] = {}

P = TypeVar("P")


def register(cls: type[P]) -> type[P]:
    """Class decorator: add a policy class to `POLICIES` under its `name`."""
    name: str = cls.name  # type: ignore[attr-defined]
    if name in POLICIES:
        raise ValueError(f"policy {name!r} registered twice")
    POLICIES[name] = cls
    return cls


class UnknownPolicyError(ValueError):
    pass


class PolicyLoadError(ValueError):
    """Valid params, but the policy cannot start with them: a checkpoint or predictor
    file missing or unreadable, or files that do not fit together."""


def build_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy with validated params.

    Raises `UnknownPolicyError`, pydantic's `ValidationError` naming the bad key, or
    `PolicyLoadError` when the policy's constructor fails (it loads its files there).
    """
    import policies  # noqa: F401  (importing the package registers every policy)

    cls = POLICIES.get(name)
    if cls is None:
        known = ", ".join(sorted(POLICIES))
        raise UnknownPolicyError(f"unknown policy {name!r}; known: {known}")
    validated = cls.Params.model_validate(params or {})
    try:
        policy: Policy = cls(validated)
    except Exception as exc:  # torch.load, ONNX Runtime etc. raise many kinds
        raise PolicyLoadError(f"policy {name} cannot start: {exc}") from exc
    return policy
