"""Client API keys, per-key model lists and per-key rate limits.

Keys are looked up by the SHA-256 of the bearer token, so neither the config nor Redis
ever holds a usable key. Limits (requests and tokens per minute) are counted in
`WindowCounters` that every replica shares through the state store (proxy/state/rate_counters.py).
Tokens are charged up front (prompt characters / `chars_per_token` + `max_tokens`, or
`default_max_tokens`), then corrected with the usage the backend reported when the
request ends (`settle`); a request that got no answer is refunded.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.config import ApiKeyConfig, AuthConfig
from proxy.errors import PermissionDenied, RateLimited, Unauthorized
from proxy.hashing import hash_key
from proxy.state.rate_counters import RateLimiter, WindowCounters, window_of
from proxy.types import Outcome, RequestContext

log = logging.getLogger("laneway")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    models: frozenset[str]  # empty: every model
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: int = 0  # flow control: higher leaves the queue first
    slo_class: str | None = None  # its requests' SLO class (None: the default one)
    hints: bool = False  # its routing-hint headers are honoured (config.ApiKeyConfig)

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    @classmethod
    def from_config(cls, cfg: ApiKeyConfig) -> ApiKey:
        return cls(cfg.name, frozenset(cfg.models), cfg.requests_per_minute,
                   cfg.tokens_per_minute, cfg.priority, cfg.slo_class, cfg.hints)


@dataclass(frozen=True, slots=True)
class Grant:
    """An admitted request's charge, settled when it ends."""

    key: ApiKey
    window: int
    prompt_estimate: int
    charged_tokens: int
    # x-ratelimit-{limit,remaining}-{requests,tokens} after this charge (OpenAI's names)
    headers: tuple[tuple[bytes, bytes], ...] = ()


def anthropic_limit_headers(headers: Iterable[tuple[bytes, bytes]]
                            ) -> tuple[tuple[bytes, bytes], ...]:
    """`Grant.headers` under the names the Anthropic API uses
    (`anthropic-ratelimit-requests-remaining`, …), for `/v1/messages` clients."""
    renamed = []
    for name, value in headers:
        _, _, kind, unit = name.decode().split("-")  # x-ratelimit-<kind>-<unit>
        renamed.append((f"anthropic-ratelimit-{unit}-{kind}".encode(), value))
    return tuple(renamed)


class Auth:
    def __init__(self, cfg: AuthConfig, counters: WindowCounters,
                 clock: Callable[[], float] = time.time) -> None:
        self.limiter = RateLimiter(counters)
        self._clock = clock
        self._store_keys: dict[str, ApiKey] = {}
        self.reload(cfg)

    def reload(self, cfg: AuthConfig) -> None:
        self.cfg = cfg
        self._config_keys = {k.sha256: ApiKey.from_config(k) for k in cfg.keys}

    def set_store_keys(self, keys: Mapping[str, Mapping[str, Any]]) -> None:
        """Keys read from the state store (sha256 -> settings); bad entries are skipped."""
        loaded: dict[str, ApiKey] = {}
        for digest, raw in keys.items():
            try:
                loaded[digest] = ApiKey.from_config(
                    ApiKeyConfig.model_validate({**raw, "sha256": digest}))
            except ValueError:
                continue
        # A name keys the rate-limit counters: a stored key may not share one with a
        # configured key or another stored key (they would share limits).
        names = [k.name for k in loaded.values()] + [k.name for k in self._config_keys.values()]
        shared = {n for n in names if names.count(n) > 1}
        if shared:
            log.warning("API keys in the state store skipped: their names are taken by "
                        "another key: %s", ", ".join(sorted(shared)))
        self._store_keys = {d: k for d, k in loaded.items() if k.name not in shared}

    def key_of(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The caller's key (None when auth is off); raises `Unauthorized`."""
        if not self.cfg.enabled:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send x-api-key instead
            token = headers.get("x-api-key", "")
        if not token.strip():
            raise Unauthorized("You didn't provide an API key. Send `Authorization: "
                               "Bearer <key>` (or `x-api-key: <key>`).")
        digest = hash_key(token.strip())
        key = self._config_keys.get(digest) or self._store_keys.get(digest)
        if key is None:
            raise Unauthorized("Incorrect API key provided.")
        return key

    def admit_read(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The key of a request that generates nothing (reading a stored response),
        charged one request against its requests per minute."""
        key = self.key_of(headers)
        if key is None:
            return None
        now = self._clock()
        self._check(key, "requests", key.requests_per_minute, 1, now)
        self.limiter.charge(f"{key.name}:requests", 1, window_of(now))
        return key

    def admit(self, headers: Mapping[str, str], ctx: RequestContext, choices: int = 1,
              model_context: int | None = None) -> Grant | None:
        """Check the key, its models and its limits, and charge the request (`choices`
        completions: `n`, `best_of`; `model_context`: its model's context length, if
        known, bounds what a request without max_tokens may generate)."""
        return self.admit_model(headers, ctx.model, len(ctx.prompt_text), ctx.max_tokens,
                                choices=choices, model_context=model_context)

    def admit_model(self, headers: Mapping[str, str], model: str, prompt_chars: int,
                    output_tokens: int | None, *, choices: int = 1,
                    model_context: int | None = None) -> Grant | None:
        """`admit` for a request on `model` of about `prompt_chars` characters of input
        that may generate `output_tokens` (None: unbounded but by the model) in each of
        `choices` completions."""
        key = self.key_of(headers)
        if key is None:
            return None
        if not key.allows(model):
            raise PermissionDenied(f"The key `{key.name}` may not use model "
                                   f"`{model}`.", param="model")
        now = self._clock()
        prompt = math.ceil(prompt_chars / self.cfg.chars_per_token)
        choices = max(choices, 1)
        if output_tokens is None:
            output_tokens = self._open_ended(key, prompt, choices, model_context)
        tokens = prompt + choices * output_tokens
        self._check(key, "requests", key.requests_per_minute, 1, now)
        self._check(key, "tokens", key.tokens_per_minute, tokens, now)
        window = window_of(now)
        self.limiter.charge(f"{key.name}:requests", 1, window)
        self.limiter.charge(f"{key.name}:tokens", tokens, window)
        return Grant(key, window, prompt, tokens, self._limit_headers(key, now))

    def _open_ended(self, key: ApiKey, prompt: int, choices: int,
                    model_context: int | None) -> int:
        """The completion tokens charged (per choice) for a request that sets no bound:
        what its model could generate (its context less the prompt), but no more than
        leaves the whole request within the key's tokens per minute (so that it fits an
        empty window), and never less than `default_max_tokens` (the only charge when
        the context is not known). Charged so, concurrent open-ended requests cannot
        together overshoot the key's limit; `settle` refunds what was not used."""
        floor = self.cfg.default_max_tokens
        if model_context is None:
            return floor
        room = model_context - prompt
        if key.tokens_per_minute is not None:
            room = min(room, (key.tokens_per_minute - prompt) // choices)
        return max(floor, room)

    def _limit_headers(self, key: ApiKey, now: float) -> tuple[tuple[bytes, bytes], ...]:
        """The key's limits and what is left of them in the sliding minute (tokens as
        charged up front), as OpenAI names them; none for a key without limits."""
        headers: list[tuple[bytes, bytes]] = []
        for name, limit in (("requests", key.requests_per_minute),
                            ("tokens", key.tokens_per_minute)):
            if limit is not None:
                left = max(0, math.floor(limit - self.limiter.used(f"{key.name}:{name}", now)))
                headers += [(f"x-ratelimit-limit-{name}".encode(), str(limit).encode()),
                            (f"x-ratelimit-remaining-{name}".encode(), str(left).encode())]
        return tuple(headers)

    def settle(self, grant: Grant | None, outcome: Outcome | None) -> None:
        """Replace the up-front token charge by the tokens really used."""
        if grant is None:
            return
        used = 0
        if outcome is not None:
            prompt = outcome.prompt_tokens
            used = (grant.prompt_estimate if prompt is None else prompt) \
                + outcome.completion_tokens
        if used != grant.charged_tokens:
            self.limiter.charge(f"{grant.key.name}:tokens", used - grant.charged_tokens,
                                grant.window)

    def visible_models(self, headers: Mapping[str, str], models: list[str]) -> list[str]:
        key = self.key_of(headers)
        return models if key is None else [m for m in models if key.allows(m)]

    def _check(self, key: ApiKey, limit_name: str, limit: int | None, cost: int,
               now: float) -> None:
        if limit is None:
            return
        subject = f"{key.name}:{limit_name}"
        wait = self.limiter.retry_after(subject, cost, limit, now)
        if wait is None:
            return
        used = round(self.limiter.used(subject, now))
        raise RateLimited(
            f"Rate limit reached for key `{key.name}` on {limit_name} per min: limit "
            f"{limit}, used {used}, requested {cost}. Please try again in {wait}s.",
            limit=limit_name, retry_after_s=wait)
