"""The client's events of a tracked stream: the plain token event's fast path (the
response's bytes around the text, built once) writes what the general one does."""

from __future__ import annotations

import orjson
import pytest

from proxy.migration.client_emit import ResponseHead, _token_event, token_event

TEXTS = ["hi", "", ' "quoted" \\ back', "line\nbreak\ttab", "ü😀\u2028", "\x00", "\ufffd"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_the_plain_event_is_the_general_one(chat: bool, text: str) -> None:
    head = ResponseHead('cmpl-"1"', 1700000000, "org/model\u00e9", chat, False)
    fast = token_event(head, text, [7, 8])
    assert fast == _token_event(head, text, [7, 8], None, None, None, None, "", None)
    assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
    event = orjson.loads(fast[6:])
    assert (event["choices"][0]["delta"]["content"] if chat
            else event["choices"][0]["text"]) == text


def test_events_off_the_fast_path_keep_their_fields() -> None:
    head = ResponseHead("cmpl-1", 1, "m", True, True)  # the client asked for token ids
    event = orjson.loads(token_event(head, "x", [5])[6:])
    assert event["choices"][0]["token_ids"] == [5]
    plain = ResponseHead("cmpl-1", 1, "m", False, False)
    last = orjson.loads(token_event(plain, "y", [6], finish_reason="stop", stop_reason="\n",
                                    fingerprint="fp")[6:])
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"],
            last["system_fingerprint"]) == ("stop", "\n", "fp")


def test_an_id_holding_the_marker_takes_the_general_path() -> None:
    odd = ResponseHead("\x00laneway-text\x00", 1, "m", True, False)
    assert token_event(odd, "z", []) == _token_event(odd, "z", [], None, None, None, None, "",
                                                     None)


def test_reasoning_deltas_are_shaped_as_vllm_shapes_them() -> None:
    head = ResponseHead("c", 1, "m", True, False)
    only = orjson.loads(token_event(head, "", [5], reasoning="think")[6:])
    both = orjson.loads(token_event(head, "say", [6], reasoning="end")[6:])
    assert only["choices"][0]["delta"] == {"reasoning": "think"}  # no content key
    assert both["choices"][0]["delta"] == {"content": "say", "reasoning": "end"}


def test_usage_in_every_chunk_counts_the_tokens_so_far() -> None:
    """As a server with `--enable-force-include-usage` writes it."""
    head = ResponseHead("c", 1, "m", False, False)
    event = orjson.loads(token_event(head, "x", [5], usage=(12, 3))[6:])
    assert event["usage"] == {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    assert "usage" not in orjson.loads(token_event(head, "x", [5])[6:])
    chat = orjson.loads(token_event(ResponseHead("c", 1, "m", True, False), "x", [5],
                                    usage=(12, 3))[6:])
    assert chat["usage"]["completion_tokens_details"] is None
