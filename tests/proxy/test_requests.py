import orjson
import pytest

from proxy.errors import InvalidRequest
from proxy.request_context import build_context, normalized, parse_body, prefix_blocks
from proxy.types import Endpoint, RequestContext

LIMIT = 4096


def ctx_of(body: dict[str, object], endpoint: Endpoint = "chat",
           headers: dict[str, str] | None = None) -> RequestContext:
    return build_context(
        parse_body(orjson.dumps(body)), endpoint, headers or {},
        request_id="r1", max_tokens_limit=LIMIT, session_header="x-session-id", block_chars=8,
    )


CHAT: dict[str, object] = {
    "model": "m", "messages": [{"role": "user", "content": "hello there, friend"}]}


def test_chat_context() -> None:
    ctx = ctx_of({**CHAT, "stream": True, "max_tokens": 7, "user": "u1"})
    assert ctx.model == "m" and ctx.stream and ctx.max_tokens == 7
    assert ctx.prompt_text == "user: hello there, friend"
    assert ctx.session == "u1"
    assert len(ctx.prompt_blocks) == len(ctx.prompt_text) // 8


def test_session_header_wins_over_user_and_slo_header() -> None:
    ctx = ctx_of({**CHAT, "user": "u1"}, headers={"x-session-id": "s9", "x-laneway-slo-ms": "250"})
    assert ctx.session == "s9"
    assert ctx.slo_ms == 250.0


def test_expected_tokens_header() -> None:
    assert ctx_of(CHAT, headers={"x-laneway-expected-tokens": "120"}).expected_tokens == 120
    assert ctx_of(CHAT).expected_tokens is None


@pytest.mark.parametrize("value", ["abc", "-5", "0", "1.5"])
def test_bad_expected_tokens_header(value: str) -> None:
    with pytest.raises(InvalidRequest, match="x-laneway-expected-tokens"):
        ctx_of(CHAT, headers={"x-laneway-expected-tokens": value})


def test_budget_and_read_rate_headers() -> None:
    ctx = ctx_of(CHAT, headers={"x-laneway-budget": "0.25", "x-laneway-read-rate": "0"})
    assert (ctx.budget, ctx.read_rate) == (0.25, 0.0)
    assert (ctx_of(CHAT).budget, ctx_of(CHAT).read_rate) == (None, None)
    assert ctx_of(CHAT, headers={"x-laneway-budget": "1"}).budget == 1.0


@pytest.mark.parametrize(("name", "value"), [
    ("x-laneway-budget", "1.01"), ("x-laneway-budget", "-0.1"), ("x-laneway-budget", "nan"),
    ("x-laneway-budget", "half"), ("x-laneway-read-rate", "inf"),
    ("x-laneway-read-rate", "-1"), ("x-laneway-read-rate", "1e6")])
def test_bad_budget_and_read_rate_headers(name: str, value: str) -> None:
    with pytest.raises(InvalidRequest, match=name):
        ctx_of(CHAT, headers={name: value})


def test_content_parts_are_text() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "b"}]
    ctx = ctx_of({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert ctx.prompt_text == "user: ab"


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompts(prompt: object) -> None:
    assert ctx_of({"model": "m", "prompt": prompt}, "completions").prompt_text


def test_zero_max_tokens_only_on_completions() -> None:
    assert ctx_of({"model": "m", "prompt": "x", "max_tokens": 0}, "completions").max_tokens == 0
    with pytest.raises(InvalidRequest, match="at least 1"):
        ctx_of({**CHAT, "max_tokens": 0})


@pytest.mark.parametrize(("endpoint", "fields", "bound"), [
    ("chat", {"max_tokens": 5, "max_completion_tokens": 9}, 9),  # vLLM's precedence
    ("chat", {"max_tokens": 5, "max_completion_tokens": None}, 5),
    ("chat", {"max_tokens": -1, "max_completion_tokens": 9}, 9),  # ignored: vLLM's to judge
    ("chat", {}, None),  # up to the model's context
    ("completions", {"max_tokens": 5, "max_completion_tokens": 9}, 5),  # vLLM ignores it
    ("completions", {"max_completion_tokens": 2**63}, 16),  # vLLM's default max_tokens
    ("completions", {"max_tokens": None}, 16),
])
def test_length_bound_is_the_one_vllm_applies(endpoint: Endpoint, fields: dict[str, object],
                                              bound: int | None) -> None:
    body = {**CHAT, **fields} if endpoint == "chat" else {"model": "m", "prompt": "x", **fields}
    assert ctx_of(body, endpoint).max_tokens == bound


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT["messages"]}, "model"),
        ({"model": 3, "messages": CHAT["messages"]}, "model"),
        ({**CHAT, "max_tokens": -1}, "max_tokens"),
        ({**CHAT, "max_tokens": LIMIT + 1}, "max_tokens"),
        ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
        ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
        ({**CHAT, "max_tokens": [5]}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": 5, "max_completion_tokens": LIMIT + 1}, "max_completion_tokens"),
        ({**CHAT, "stream": "maybe"}, "stream"),
        ({**CHAT, "stream": 2}, "stream"),
    ],
)
def test_invalid_fields_name_the_param(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ctx_of(body)
    assert info.value.param == param


@pytest.mark.parametrize(("fields", "stream", "bound"), [
    ({"max_tokens": "8"}, False, 8),  # pydantic's lax mode, as vLLM reads them
    ({"max_tokens": 8.0, "stream": "true"}, True, 8),
    ({"max_completion_tokens": " 3 ", "stream": 1}, True, 3),
    ({"max_tokens": True, "stream": "off"}, False, 1),
    ({"stream": None}, False, None),
])
def test_what_vllm_reads_in_its_lax_mode_the_proxy_reads_alike(
        fields: dict[str, object], stream: bool, bound: int | None) -> None:
    ctx = ctx_of({**CHAT, **fields})
    assert (ctx.stream, ctx.max_tokens) == (stream, bound)


def test_a_body_goes_upstream_with_the_fields_written_as_the_proxy_read_them() -> None:
    plain = {**CHAT, "max_tokens": 8, "stream": True}
    assert normalized(plain, ctx_of(plain)) is plain  # nothing to write: the same body
    lax = {**CHAT, "max_tokens": "8", "stream": "true", "user": "u"}
    assert normalized(lax, ctx_of(lax)) == {**lax, "max_tokens": 8, "stream": True}
    unnamed = {k: v for k, v in CHAT.items() if k != "model"}
    ctx = build_context(unnamed, "chat", {}, request_id="r", max_tokens_limit=LIMIT,
                        session_header="x-session-id", block_chars=8, default_model="d")
    assert normalized(unnamed, ctx) == {**unnamed, "model": "d"}


def test_content_the_proxy_cannot_read_is_the_backends_to_judge() -> None:
    ctx = ctx_of({"model": "m", "messages": [{"role": "user", "content": 5},
                                             {"role": "user", "content": {}}, "hi"]})
    assert ctx.prompt_text == "user: \nuser: "
    messages: object
    for messages in (None, [], "hi"):  # vLLM's Messages API takes [] after a system
        assert ctx_of({"model": "m", "messages": messages}).prompt_text == ""
    assert ctx_of({**CHAT, "user": []}).session is None  # (vLLM: a 400 on chat)


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], {}, 5])
def test_a_prompt_the_proxy_cannot_read_is_the_backends_to_judge(prompt: object) -> None:
    assert ctx_of({"model": "m", "prompt": prompt}, "completions").prompt_text == ""


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b'"s"', b"\xff\xfe"])
def test_bad_bodies(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_body(raw)


@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf", "nan"])
def test_bad_slo_header(value: str) -> None:
    with pytest.raises(InvalidRequest, match="x-laneway-slo-ms"):
        ctx_of(CHAT, headers={"x-laneway-slo-ms": value})


def test_prefix_blocks_share_prefixes() -> None:
    a = prefix_blocks("A" * 32 + "tail one", 8)
    b = prefix_blocks("A" * 32 + "tail two", 8)
    c = prefix_blocks("B" + "A" * 31 + "tail one", 8)
    assert a[:4] == b[:4] and a[4] != b[4]
    assert not set(a) & set(c)  # cumulative: a different first block changes every id
    assert prefix_blocks("short", 8) == ()
