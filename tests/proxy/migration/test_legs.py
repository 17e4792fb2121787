"""A leg decodes a backlog of upstream events a bounded batch at a time."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from proxy.migration.legs import MAX_PIECES, Leg, LegFailed
from proxy.relay.upstream import Opened
from proxy.types import Backend


class _Response:
    """An aiohttp response whose whole body already came with the head."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _event(token: int) -> bytes:
    choice = {"index": 0, "delta": {"content": f" t{token}"}, "token_ids": [token],
              "finish_reason": "length" if token == 79 else None}
    return b"data: " + orjson.dumps({"id": "c", "choices": [choice]}) + b"\n\n"


async def test_a_backlog_is_decoded_a_batch_at_a_time_in_order_up_to_done() -> None:
    # 80 events in one chunk (a proxy that fell behind), then [DONE] and a stray event
    head = b"".join(_event(i) for i in range(80)) + b"data: [DONE]\n\n" + _event(999)
    opened = Opened(Backend("b", "http://b", "m"), _Response(), head,  # type: ignore[arg-type]
                    complete=False)
    leg = Leg(opened, chat=True, guard=contextlib.ExitStack(), read_timeout_s=5)
    batches = []
    while pieces := await leg.read():
        batches.append([p.token_ids[0] for p in pieces])
    leg.close()
    assert [len(b) for b in batches] == [MAX_PIECES, MAX_PIECES, 80 - 2 * MAX_PIECES]
    assert [token for batch in batches for token in batch] == list(range(80))
    assert leg.tokens == 80
    assert await leg.read() == []  # nothing after [DONE]


async def test_the_events_before_a_bad_one_come_first() -> None:
    """A chunk with good events then an error event: the good ones are read, and the
    failure (here a refusal: a 4xx error event) on the next read."""
    refusal = b'{"error": {"message": "no", "code": 400}}'
    head = _event(0) + _event(1) + b"data: " + refusal + b"\n\n"
    opened = Opened(Backend("b", "http://b", "m"), _Response(), head,  # type: ignore[arg-type]
                    complete=False)
    leg = Leg(opened, chat=True, guard=contextlib.ExitStack(), read_timeout_s=5)
    assert [p.token_ids for p in await leg.read()] == [[0], [1]]
    with pytest.raises(LegFailed) as failed:
        await leg.read()
    leg.close()
    assert failed.value.kind == "refused" and failed.value.refusal == (400, refusal)


def _piece_event(ids: list[int], text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c", "choices": [choice]}) + b"\n\n"


async def test_a_replay_drops_what_the_client_has() -> None:
    """A continuation started before where the client is: its first ids and characters
    are dropped, a piece left with nothing is skipped, one straddling the point kept in
    part."""
    head = (_piece_event([1], "") + _piece_event([2, 3], "ab") + _piece_event([4], "c")
            + _piece_event([5], "d", "length") + b"data: [DONE]\n\n")
    opened = Opened(Backend("b", "http://b", "m"), _Response(), head,  # type: ignore[arg-type]
                    complete=False)
    leg = Leg(opened, chat=False, guard=contextlib.ExitStack(), read_timeout_s=5)
    leg.replay(2, 1)
    pieces = await leg.read()
    leg.close()
    assert [(p.token_ids, p.text, p.finish_reason) for p in pieces] == [
        ([3], "b", None), ([4], "c", None), ([5], "d", "length")]
    assert leg.tokens == 3 and leg.replayed == 2
