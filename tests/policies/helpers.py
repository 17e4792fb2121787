from __future__ import annotations

from collections.abc import Mapping

from proxy.request_context import prefix_blocks
from proxy.types import Backend, BackendStats, ClusterView, Outcome, RequestContext


def backends(n: int) -> tuple[Backend, ...]:
    return tuple(Backend(f"b{i}", f"http://b{i}", "m") for i in range(n))


def view(
    candidates: tuple[Backend, ...],
    inflight: Mapping[str, int] | None = None,
    stats: Mapping[str, BackendStats] | None = None,
    now: float = 0.0,
) -> ClusterView:
    return ClusterView(candidates, stats or {}, inflight or {}, now)


def ctx(prompt: str = "hello", *, request_id: str = "r", session: str | None = None,
        max_tokens: int | None = 16) -> RequestContext:
    return RequestContext(
        request_id=request_id, endpoint="completions", model="m", prompt_text=prompt,
        prompt_blocks=prefix_blocks(prompt, 16), stream=False, max_tokens=max_tokens,
        session=session)


def outcome(request_id: str, backend: str, tokens: int, *, at: float = 0.0) -> Outcome:
    return Outcome(request_id=request_id, model="m", backend=backend, policy="p", status=200,
                   ok=True, started_at=at, ttft_s=0.1, e2e_s=0.0, completion_tokens=tokens,
                   prompt_tokens=0)
