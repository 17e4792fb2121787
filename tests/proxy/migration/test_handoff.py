"""Where a continuation starts: never inside a multi-byte character (vllm#48853)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson

from proxy.migration.handoff import clean_start
from proxy.relay.upstream import UpstreamFailure
from proxy.types import Backend

TARGET = Backend("t", "http://t", "m")
# a byte-level vocabulary: " caf" + "é" in two bytes, " ok", and "日" in 2 + 1 bytes
VOCAB = {1: b" caf", 2: b"\xc3", 3: b"\xa9", 4: b" ok", 5: b"\xe6\x97", 6: b"\xa5"}


class _Upstream:
    """vLLM's /detokenize of the vocabulary above; `None`: a backend without it."""

    def __init__(self, serves: bool = True) -> None:
        self.serves, self.asked = serves, list[list[int]]()

    async def call_json(self, backend: Backend, path: str, body: bytes,
                        headers: dict[str, str], timeout_s: float | None = None) -> Any:
        assert path == "/detokenize" and timeout_s is not None
        ids = orjson.loads(body)["tokens"]
        self.asked.append(ids)
        if not self.serves:
            raise UpstreamFailure(backend, "status", "HTTP 404")
        return {"prompt": b"".join(VOCAB[i] for i in ids).decode(errors="replace")}


def _continuation(upstream: _Upstream) -> Any:
    registry = SimpleNamespace(model_on=lambda backend, model: model)
    return SimpleNamespace(rt=SimpleNamespace(upstream=upstream, registry=registry),
                           model="m", headers={})


async def test_a_clean_end_costs_nothing() -> None:
    upstream = _Upstream()
    assert await clean_start(_continuation(upstream), TARGET, [1, 2, 3], (0, 0)) == (0, 0)
    assert upstream.asked == []


async def test_the_nearest_clean_boundary_is_found() -> None:
    """A packed piece " ok" + the first bytes of "日" (its start known clean): the
    target says the end is inside a character, the boundary before the last token is
    not; the client has no text of that token yet."""
    upstream = _Upstream()
    assert await clean_start(_continuation(upstream), TARGET, [1, 2, 3, 4, 5],
                             (2, 3)) == (1, 0)
    assert upstream.asked == [[1, 2, 3, 4, 5], [1, 2, 3, 4]]


async def test_no_nearer_clean_boundary_than_the_known_one() -> None:
    upstream = _Upstream()
    assert await clean_start(_continuation(upstream), TARGET, [1, 2], (1, 0)) == (1, 0)
    assert upstream.asked == [[1, 2]]


async def test_a_backend_that_cannot_tell_continues_from_the_known_boundary() -> None:
    upstream = _Upstream(serves=False)
    assert await clean_start(_continuation(upstream), TARGET, [1, 2, 3, 4, 5],
                             (2, 3)) == (2, 3)
    assert len(upstream.asked) == 1


async def test_only_the_last_ids_are_decoded() -> None:
    upstream = _Upstream()
    generated = [4] * 20 + [5]
    assert await clean_start(_continuation(upstream), TARGET, generated, (1, 0)) == (1, 0)
    assert upstream.asked == [[4] * 7 + [5]]
