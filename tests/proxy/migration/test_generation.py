"""The proxy's own view of a tracked generation: hold-back, stop strings, splicing."""

from __future__ import annotations

import orjson
import pytest

from proxy.migration.eligibility import (
    continuation_body,
    penalty_bias,
    resumed_seed,
    tracked_body,
    tracking_of,
    why_not_migratable,
)
from proxy.migration.event_pieces import Piece, UpstreamEventError, parse_event
from proxy.migration.generation import Generation
from proxy.relay.sse import EventSplitter


def feed(gen: Generation, *texts: str, finish: str | None = None,
         stop_reason: str | None = None) -> str:
    out = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        release = gen.add(Piece(text, [i], finish if last else None,
                                stop_reason if last else None))
        out.append(release.text)
        if gen.finished:
            break
    return "".join(out)


def test_without_stop_strings_text_is_released_at_once() -> None:
    gen = Generation()
    assert gen.add(Piece("Hello", [1])).text == "Hello"
    assert gen.add(Piece(" world", [2], "length")).finish_reason == "length"
    assert gen.token_ids == [1, 2] and "".join(gen.text_parts) == "Hello world"


def test_stop_text_is_held_back_like_vllm_and_removed() -> None:
    gen = Generation(stops=("END",))
    assert gen.add(Piece("abc", [1])).text == "a"  # two characters could start "END"
    release = gen.add(Piece("dEN", [2]))
    assert release.text == "bcd" and not gen.finished
    release = gen.add(Piece("Dxyz", [3]))
    assert (release.text, release.finish_reason, release.stop_reason) == ("", "stop", "END")
    assert "".join(gen.text_parts) == "abcd"


def test_no_stop_string_counts_within_min_tokens() -> None:
    """As vLLM's detokenizer: stops are looked for once more than `min_tokens` tokens
    are out, and only those ending past the text of the first `min_tokens`."""
    gen = Generation(stops=("e",), min_tokens=3)
    assert feed(gen, "one", " two", " three", " eel") == "one two three "
    assert gen.stop_reason == "e"
    straddling = Generation(stops=("ab",), min_tokens=1)  # "a" within, "b" past it
    assert feed(straddling, "xa", "b", "c") == "x" and straddling.stop_reason == "ab"


def test_the_stop_string_completing_first_wins() -> None:
    gen = Generation(stops=("abc", "b"))  # vLLM: "b" ends first, though "abc" starts first
    assert feed(gen, "xabc") == "xa" and gen.stop_reason == "b"
    tie = Generation(stops=("bc", "abc"))  # both end at "c": the list's order
    assert feed(tie, "xabc") == "xa" and tie.stop_reason == "bc"


def test_stop_string_straddling_two_backends_stops() -> None:
    gen = Generation(stops=("STOP",))
    text = feed(gen, "the ST")  # backend A's last piece
    text += feed(gen, "OP and more")  # backend B's first piece
    assert text == "the " and gen.finish_reason == "stop"


def test_included_stop_string_is_kept_and_nothing_is_held() -> None:
    gen = Generation(stops=("STOP",), include_stop=True)
    assert gen.add(Piece("the ST", [1])).text == "the ST"
    assert gen.add(Piece("OP!", [2])).text == "OP"
    assert gen.stop_reason == "STOP"


def test_backend_reported_stop_is_trimmed_from_the_tail() -> None:
    gen = Generation(stops=("\n\n",))
    text = feed(gen, "para", "graph\n\n", finish="stop", stop_reason="\n\n")
    assert text == "paragraph"


def test_earliest_of_several_stop_strings_wins() -> None:
    gen = Generation(stops=("zzz", "b"))
    assert feed(gen, "aaab zzz") == "aaa" and gen.stop_reason == "b"


def test_a_piece_ending_in_a_partial_character_is_not_a_clean_splice_point() -> None:
    gen = Generation()
    gen.add(Piece("caf\ufffd", [1]))
    assert not gen.clean_boundary
    gen.add(Piece("é", [2]))
    assert gen.clean_boundary


def test_where_the_text_last_decoded_completely() -> None:
    """vLLM sends a token's text once it decodes completely: a one-token piece with
    text ends at a clean boundary, one without text (a byte of a character) does not,
    and a piece starting with an ASCII character starts at one. Of a piece packing
    several tokens, the end is unknown."""
    gen = Generation()
    assert gen.since_clean == (0, 0)
    gen.add(Piece(" caf", [1]))
    assert gen.since_clean == (0, 0)
    gen.add(Piece("", [2]))  # the first byte of "é"
    assert gen.since_clean == (1, 0)
    gen.add(Piece("é", [3]))
    assert gen.since_clean == (0, 0)
    gen.add(Piece(" au lait", [4, 5, 6]))  # packed: its start is clean (ASCII)
    assert gen.since_clean == (3, 8)
    gen.add(Piece("ü", [7, 8]))  # packed, starting with a completed character
    assert gen.since_clean == (5, 9)
    gen.add(Piece("", [9]))
    assert (gen.clean_at, gen.since_clean) == (3, (6, 9))
    gen.add(Piece("!", [10]))
    assert gen.since_clean == (0, 0)


def test_sse_splitter_joins_events_cut_anywhere() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\n: comment\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        splitter = EventSplitter()
        payloads = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert payloads == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


@pytest.mark.parametrize(("chunks", "payloads"), [
    ([b'data: {"a":1}\n\n'], [b'{"a":1}']),  # the usual chunk (the fast path)
    ([b"data: x\r\n\r\n"], [b"x"]),  # CRLF lines
    ([b"data: x\r\n\n"], [b"x"]),
    ([b"data: a\ndata: b\n\n"], [b"a\nb"]),  # one event of two data lines
    ([b"data: a\n\ndata: b\n\n"], [b"a", b"b"]),  # two events in one chunk
    ([b"data: a", b"b\n\n", b'data: {"c":3}\n\n'], [b"ab", b'{"c":3}']),
    ([b": comment\n\n", b"data:x\n\n"], [b"x"]),
])
def test_sse_splitter_shapes(chunks: list[bytes], payloads: list[bytes]) -> None:
    splitter = EventSplitter()
    assert [p for chunk in chunks for p in splitter.feed(chunk)] == payloads


def test_pieces_of_chat_and_completion_events() -> None:
    chat = parse_event(orjson.dumps({"id": "c", "choices": [
        {"index": 0, "delta": {"content": "hi"}, "token_ids": [5, 6],
         "finish_reason": "stop", "stop_reason": 7}]}), chat=True)
    assert (chat.text, chat.token_ids, chat.finish_reason, chat.stop_reason) == (
        "hi", [5, 6], "stop", 7)
    completion = parse_event(orjson.dumps({"choices": [
        {"text": "x", "token_ids": [1], "prompt_token_ids": [9, 9]}]}), chat=False)
    assert completion.prompt_token_ids == [9, 9]
    with pytest.raises(UpstreamEventError):
        parse_event(b'{"error": {"message": "boom"}}', chat=True)


@pytest.mark.parametrize(("chat", "event"), [
    (True, {"choices": 5}),
    (True, {"choices": [{"delta": "x"}]}),
    (True, {"choices": [{"delta": {"content": 5}}]}),
    (True, {"choices": [{"delta": {"content": ["x"]}}]}),
    (True, {"choices": [{"delta": {"reasoning": 3}}]}),
    (True, {"choices": [{"delta": {"content": "a"}, "token_ids": "abc"}]}),
    (True, {"choices": [], "prompt_token_ids": "x"}),
    (False, {"choices": [{"text": 1}]}),
    (False, {"choices": [{"text": "a", "token_ids": {"a": 1}}]}),
    (False, {"choices": [{"text": "a", "prompt_token_ids": 4}]}),
], ids=str)
def test_a_malformed_event_is_the_backends_error(chat: bool, event: object) -> None:
    """Shapes the relay and a continuation cannot use fail the leg (the stream moves,
    or ends with an error event) instead of breaking the proxy (a 500)."""
    with pytest.raises(UpstreamEventError, match="malformed stream event"):
        parse_event(orjson.dumps(event), chat=chat)


@pytest.mark.parametrize(("extra", "reason"), [
    ({"n": 2}, "n > 1"), ({"logprobs": True}, "logprobs"), ({"echo": True}, "echo"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "structured output"),
    ({"response_format": {"type": "text"}}, None), ({"n": 1, "logprobs": False}, None),
    # usage in every chunk (vLLM: only with include_usage too)
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True},
      "stream": True}, "continuous usage stats"),
    ({"stream_options": {"continuous_usage_stats": True}, "stream": True}, None),
    ({"stream_options": {"include_usage": True}}, "stream options without a stream"),
    ({"use_beam_search": True}, "beam search"),  # vLLM refuses to stream it
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"include_reasoning": False}, "hidden reasoning"), ({"include_reasoning": True}, None),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     "multimodal input"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, None),
])
def test_which_requests_can_move(extra: dict[str, object], reason: str | None) -> None:
    assert why_not_migratable({"messages": [], **extra}, chat=True) == reason


def test_batched_prompts_do_not_move() -> None:
    assert why_not_migratable({"prompt": ["a", "b"]}, chat=False) == "batched prompt"
    assert why_not_migratable({"prompt_embeds": "AAAA"}, chat=False) == "prompt embeddings"
    assert why_not_migratable({"prompt": [1, 2, 3]}, chat=False) is None


def test_continuation_carries_sampling_and_the_remaining_budget() -> None:
    data = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.7,
            "top_p": 0.9, "seed": 3, "stop": "END", "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "tools_choice_unknown": 1}
    tracking = tracking_of(data, max_tokens=20)
    first = orjson.loads(tracked_body(data, tracking))
    assert first["return_token_ids"] and first["include_stop_str_in_output"]
    assert "stream_options" not in first
    body = orjson.loads(continuation_body(data, tracking, "m2", [1, 2, 7, 8, 9], 3))
    assert body == {"model": "m2", "prompt": [1, 2, 7, 8, 9], "temperature": 0.7,
                    "top_p": 0.9, "seed": resumed_seed(3, 3), "max_tokens": 17, "min_tokens": 2,
                    "stop": ["END"], "include_stop_str_in_output": True, "stream": True,
                    "return_token_ids": True}
    warm = orjson.loads(continuation_body(data, tracking, "m2", [1, 2, 7], 1, warm=True))
    assert warm["max_tokens"] == 1 and warm["stream"] is False and warm["prompt"] == [1, 2, 7]


def test_a_continuation_keeps_the_tenants_cache_salt_and_request_options() -> None:
    """Without its salt a continuation's blocks (the tenant's prompt and answer) would
    land in the shared prefix-cache namespace, where other tenants can probe them."""
    options = {"cache_salt": "tenant-a", "watermarking": True, "session_id": "s",
               "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
               "thinking_token_budget": 8, "vllm_xargs": {"k": 1}}
    data = {"model": "m", "prompt": "x", **options, "request_id": "r1",
            "kv_transfer_params": None, "truncate_prompt_tokens": 2}
    tracking = tracking_of(data, max_tokens=5)
    for warm in (False, True):
        body = orjson.loads(continuation_body(data, tracking, "m", [1, 2], 1, warm=warm))
        assert options.items() <= body.items()
        assert not {"request_id", "kv_transfer_params", "truncate_prompt_tokens"} & set(body)


def test_a_continuation_draws_other_random_numbers_than_the_start() -> None:
    """vLLM restarts a seeded request's random stream: the same seed would reuse the
    draws of the first tokens (after a move at 0, it is the same request)."""
    data = {"model": "m", "prompt": "x", "temperature": 0.8, "seed": 7}
    tracking = tracking_of(data, max_tokens=20)
    seeds = [orjson.loads(continuation_body(data, tracking, "m", [1, 2, 3], done))["seed"]
             for done in (0, 1, 2)]
    assert seeds[0] == 7 and len({7, *seeds[1:]}) == 3
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert seeds[1] == orjson.loads(continuation_body(data, tracking, "m", [1, 2, 3], 1))["seed"]


def test_a_continuation_pays_the_penalties_of_the_tokens_before_it() -> None:
    """Frequency and presence penalties count the request's output only; the tokens
    generated before a move are prompt tokens to the target, so they come as bias."""
    data = {"model": "m", "prompt": "x", "frequency_penalty": 0.5, "presence_penalty": 0.25,
            "logit_bias": {"9": 3, "40": -100}}
    tracking = tracking_of(data, max_tokens=20)
    body = orjson.loads(continuation_body(data, tracking, "m", [1, 2, 9, 9, 40, 9], 4))
    assert body["logit_bias"] == {"9": 3 - 3 * 0.5 - 0.25,  # generated 3 times
                                  "40": -100.0}  # vLLM's bound
    rebased = orjson.loads(continuation_body(data, tracking, "m", [1, 2, 5, 6], 9,
                                             output_from=3))
    assert rebased["logit_bias"] == {"9": 3, "40": -100, "6": -0.75}
    plain = {"model": "m", "prompt": "x", "logit_bias": {"9": 3}}
    assert orjson.loads(continuation_body(plain, tracking_of(plain, 20), "m", [1, 9], 1)
                        )["logit_bias"] == {"9": 3}  # the client's, untouched
    assert penalty_bias(data, []) is None and penalty_bias(
        {**data, "logit_bias": {"a": 1}}, [9]) is None


def test_a_chat_without_a_bound_continues_up_to_the_targets_context() -> None:
    """A completion without max_tokens stops at 16; the chat would have gone on."""
    data = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    tracking = tracking_of(data, max_tokens=None)
    body = orjson.loads(continuation_body(data, tracking, "m", [1, 2, 3], 1, context=1024))
    assert body["max_tokens"] == 1024  # vLLM bounds it by the room left
    assert "max_tokens" not in orjson.loads(continuation_body(data, tracking, "m", [1, 2], 1))


def test_ids_packed_after_the_stop_are_not_counted() -> None:
    gen = Generation(stops=("STOP",), include_stop=True)
    gen.add(Piece("one ", [1]))
    release = gen.add(Piece("STOP and on and on", [2, 3, 4, 5]))  # 4 tokens in one event
    assert release.text == "STOP" and release.finish_reason == "stop"
    assert gen.token_ids == [1, 2]  # "STOP" is the first ~quarter of the piece's text
