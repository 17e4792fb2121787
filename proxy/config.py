"""One configuration tree, loaded from YAML and overridable by `LANEWAY_…` env vars.

Env vars use `__` between nested keys, e.g. `LANEWAY_SERVER__PORT=9000` or
`LANEWAY_POLICY__NAME=least_request`. Env overrides YAML; YAML overrides defaults.
Unknown keys and bad values fail at start with the key's dotted path in the message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy.allowlist import allowlist_entry
from proxy.hashing import hash_key
from proxy.tls import check_server_tls, upstream_context

if TYPE_CHECKING:
    from policies.base import Policy


# A backend's label `scheduler: slice` (the SLICE plugin: vllm_xargs and priority) or
# `scheduler: priority` (`--scheduling-policy priority`: priority only) opts it in to
# receiving a request's SLO class (proxy/admission/slo_classes.py).
SCHEDULER_LABEL, SCHEDULERS = "scheduler", ("slice", "priority")
_SLO_CLASS_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ConfigError(ValueError):
    """A configuration file or env var is invalid; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="larger bodies get 413")
    body_timeout_s: float = Field(60.0, gt=0, description="a request body not received "
                                  "whole within this gets 408 and its connection closes")
    header_timeout_s: float = Field(30.0, gt=0, description="a request's headers not "
                                    "received whole within this (from the connection's "
                                    "start, or the request's first byte): 408, closed")
    request_timeout_s: float = Field(90.0, gt=0, description="a request (headers and "
                                     "body) not received whole within this of its first "
                                     "byte: 408 (or, answered already, closed)")
    write_timeout_s: float = Field(60.0, gt=0, description="a client that reads none of "
                                   "its answer for this long (the send buffer stays full) "
                                   "is disconnected, and its request ends")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request line + "
                                  "headers larger than this get 431 (cut while read)")
    max_header_count: int = Field(100, ge=8, description="more header lines get 431")
    max_body_bytes_in_flight: int = Field(64 * 1024 * 1024, ge=1024, description="the "
                                          "bodies of all requests in progress (their "
                                          "content-length; max_body_bytes for a chunked "
                                          "one) add up to at most this: past it, 503 "
                                          "before the body is read")
    max_json_depth: int = Field(64, ge=2, le=200, description="JSON bodies nested deeper "
                                "(arrays, objects) get 400")
    max_tokens_limit: int = Field(131_072, gt=0, description="larger max_tokens get 400")
    session_header: str = Field("x-session-id", description="header naming a session")
    default_model: str | None = Field(None, min_length=1, description="the model of an "
                                      "OpenAI-API request that names none (no `model`, "
                                      "null or \"\"), as vLLM answers it with its one "
                                      "model; null: the fleet's model if it serves "
                                      "exactly one, else such a request is a 400")
    prefix_block_chars: int = Field(128, gt=0, description="block size of prompt hashing")
    log_level: str = "info"
    log_format: Literal["text", "json"] = Field("text", description="json: one JSON "
                                                "object per log line (README, Logs)")
    access_log: bool = Field(False, description="one line per HTTP request on the "
                             "logger laneway.access (README, Logs)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After sent with 503")
    shutdown_timeout_s: int = Field(30, ge=0, description="finish open streams on stop")
    keep_alive_s: int = Field(75, ge=1, description="idle client connection lifetime "
                              "between requests (bytes that begin no request do not "
                              "extend it)")
    tls_certfile: str | None = Field(None, description="serve HTTPS with this "
                                     "certificate (PEM, with its chain); null: HTTP")
    tls_keyfile: str | None = Field(None, description="the certificate's private key (PEM)")
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="browser origins allowed to call the API "
        "(CORS), e.g. [https://app.example.com], or [\"*\"] for any; empty: no CORS")


class KvEventsConfig(_Section):
    """Where a vLLM backend publishes its KV cache events (`--kv-events-config`), and
    how it hashes its blocks; docs/kv_events.md."""

    endpoint: str = Field(pattern=r"^(tcp|ipc)://.+", description="vLLM's PUB socket, "
                          "e.g. tcp://10.0.0.5:5557; with `bind`, the address this proxy "
                          "binds and vLLM connects to")
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://.+", description="vLLM's "
                                        "replay (ROUTER) socket, e.g. tcp://10.0.0.5:5558; "
                                        "null: a gap drops the backend's blocks instead")
    topic: str = Field("", description="vLLM's `topic`; only this exact topic is read")
    bind: bool = Field(False, description="this proxy binds `endpoint` (vLLM connects when "
                       "its endpoint has no `*` or `::`); false: connect to vLLM's")
    data_parallel_size: int = Field(1, ge=1, le=1024, description="ranks; rank r publishes "
                                    "on the endpoint's port + r")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        "sha256", description="the server's --prefix-caching-hash-algo (xxhash: unsupported)")
    hash_seed: str | None = Field(None, description="the server's PYTHONHASHSEED verbatim; "
                                  "null: unset")
    block_size: int = Field(16, ge=1, le=65_536, description="the server's --block-size "
                            "(vLLM's default: 16 on GPU, 128 on CPU)")

    @model_validator(mode="after")
    def _connectable(self) -> KvEventsConfig:
        if not self.bind and ("*" in self.endpoint or "//[::]" in self.endpoint):
            raise ValueError(f"kv_events.endpoint {self.endpoint!r} is a bind address: "
                             "give the backend's address to connect to, or set bind: true")
        if self.replay_endpoint is not None and "*" in self.replay_endpoint:
            raise ValueError(f"kv_events.replay_endpoint {self.replay_endpoint!r} is a bind "
                             "address: vLLM binds it; give the backend's address")
        return self


class BackendConfig(_Section):
    name: str = Field(min_length=1)
    url: HttpUrl
    model: str = Field(min_length=1, description="served model name")
    labels: dict[str, str] = Field(default_factory=dict)
    api_key: SecretStr | None = Field(None, description="sent to this backend as "
                                      "`Authorization: Bearer <key>` (vLLM's --api-key) "
                                      "instead of the client's; null: upstream.api_key")
    kv_events: KvEventsConfig | None = Field(None, description="the backend's KV cache "
                                             "events (policy kv_aware); null: none")

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: HttpUrl) -> HttpUrl:
        """`user:pass@` would be logged and listed with the URL; a backend's secret
        is its `api_key`."""
        if url.username or url.password:
            raise ValueError("a backend URL must not carry credentials (user:password@); "
                             "give the backend an api_key instead")
        return url


class PolicyConfig(_Section):
    name: str = "round_robin"
    params: dict[str, Any] = Field(default_factory=dict)


class UpstreamConfig(_Section):
    """Timeouts and retries of requests relayed to backends."""

    connect_timeout_s: float = Field(3.0, gt=0)
    first_byte_timeout_s: float = Field(300.0, gt=0, description="until headers + 1st chunk")
    read_timeout_s: float = Field(
        60.0, gt=0, description="max gap between body chunks (a stream's, or a whole "
        "answer's after its headers)")
    max_attempts: int = Field(3, ge=1, description="backends tried before the first byte")
    retry_window_s: float = Field(
        0.0, ge=0, description="a request none of whose backends answered (none routable, "
        "or each of its `max_attempts` failed; fallbacks included) waits and tries them "
        "all again, with backoff from 0.1 s to 1 s, until this long after it arrived, "
        "instead of getting 503/502/504 at once: it rides out a backend restart or a "
        "drain of the only backend. 0: answer at once")
    pool_size: int = Field(0, ge=0, description="max open connections; 0 = unlimited")
    tls_ca_file: str | None = Field(
        None, description="CA bundle (PEM) that `https://` backends' certificates are "
        "verified against (a private CA); null: the system's CAs")
    keepalive_s: float = Field(
        4.0, gt=0, description="idle upstream connections are dropped after this; keep it "
        "below the backends' own keep-alive (vLLM: 5 s) so a reused one is never stale")
    api_key: SecretStr | None = Field(
        None, description="the key of every backend without its own `api_key` (vLLM's "
        "--api-key), sent as `Authorization: Bearer <key>`; set it by env "
        "(LANEWAY_UPSTREAM__API_KEY) to keep it out of the file. null: the client's "
        "Authorization is forwarded, unless `auth` is on (the client's laneway key is "
        "never sent to a backend)")


class PollerConfig(_Section):
    interval_s: float = Field(
        0.05, gt=0, description="scrape every backend this often; a policy sees stats at "
        "most about this old plus one scrape (llm-d's EPP: 50 ms); at 512 backends 0.1 s "
        "costs the proxy ~0.45 cores and 0.05 s ~0.8 (README, Scale)")
    timeout_s: float = Field(1.0, gt=0)
    unhealthy_after: int = Field(3, ge=1, description="consecutive failed scrapes")
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    filter_families: bool = Field(True, description="ask /metrics for only the samples "
                                  "the router reads (`?name[]=`, honoured by vLLM's "
                                  "prometheus_client); off: fetch the whole page")
    route_when_all_unhealthy: bool = Field(
        True, description="when every scraped, non-draining backend of a model is "
        "unhealthy, route among them anyway (Envoy's panic mode) instead of answering "
        "503 at once: scrapes that time out on a starved machine must not reject "
        "requests the backends could serve; dead ones still fail over, and a request "
        "no backend accepted gets 503")
    models_interval_s: float = Field(
        10.0, ge=0, description="read each healthy backend's /v1/models this often: "
        "the LoRA adapters and other names it serves become routable to it (README, "
        "LoRA adapters), and its context length (the bound of a moved request "
        "without max_tokens); 0: only each backend's configured model, and such "
        "requests do not move")
    require_listed_model: bool = Field(
        True, description="a backend whose /v1/models (read every `models_interval_s`) "
        "does not list its configured model gets no requests for it until it does: vLLM "
        "answers each with a 404 (a server restarted with another model, a wrong "
        "--served-model-name); false: route there anyway (a server that takes names it "
        "does not list)")


class OutliersConfig(_Section):
    """Passive health: a backend that fails most of what it is sent is taken out for a
    while, though it answers its scrapes (README, Failure handling; proxy/fleet/outliers.py)."""

    failures: int = Field(
        5, ge=0, description="eject a backend once this many of its attempts failed "
        "within `window_s` (a 5xx, a timeout, a stream that broke, stalled or "
        "aborted; not a refused connection, which the poller acts on; never the "
        "client's error); 0: never eject")
    failure_ratio: float = Field(
        0.5, ge=0, le=1, description="... and they are at least this share of its "
        "attempts in the window (a busy backend's occasional failures do not eject it)")
    window_s: float = Field(10.0, gt=0, description="attempts and failures are counted "
                            "over this long")
    eject_s: float = Field(
        30.0, gt=0, description="an ejected backend is unhealthy this long, doubled for "
        "each ejection that follows within `max_eject_s` of the end of the one before; "
        "then its next good scrape brings it back")
    max_eject_s: float = Field(300.0, gt=0, description="the longest ejection")
    max_ejection_percent: float = Field(
        10.0, ge=0, le=100, description="at most this share of the backends of a model "
        "are out by passive health at once, but one always may be (Envoy's "
        "max_ejection_percent): requests that fail on every backend (a prompt that "
        "crashes vLLM, sent again and again) must not take the fleet out")


class MigrationConfig(_Section):
    """Moving running requests between backends by token ids (see README, Migration)."""

    enabled: bool = Field(True, description="track token ids of eligible streams so "
                          "they can move; off: plain byte relay, no mid-stream moves")
    on_failure: bool = Field(True, description="a backend failing mid-stream: continue "
                             "the stream on another backend instead of an error event")
    non_stream: bool = Field(False, description="track non-streamed requests too (the "
                             "backend streams to the proxy); always on for forced moves")
    max_per_request: int = Field(3, ge=0, description="handoffs allowed per request")
    check_every_tokens: int = Field(50, ge=1, description="τ: a rerouting policy looks "
                                    "at a stream every this many generated tokens")
    warm_prefill: bool = Field(True, description="prefill the target first while the "
                               "source keeps streaming, so the cut-over stall is short")
    handoff_timeout_s: float = Field(30.0, gt=0, description="give up a handoff (and "
                                     "stay on the source) after this long")
    pace_slowdown: float = Field(0.25, ge=0, description="greedy streams: while the "
                                 "target catches up, show the source's tokens this much "
                                 "slower (0.25: 1.25x TPOT) instead of freezing; 0: freeze")
    pace_timeout_s: float = Field(3.0, gt=0, description="give up a paced catch-up (then "
                                  "freeze) after this long")
    pace_default_tpot_s: float = Field(0.03, gt=0, description="pace base when the "
                                       "source's TPOT is not known yet")


class FlowControlConfig(_Section):
    """Requests wait in the proxy while every backend of their model is full, and leave
    by priority, fairly across keys (README, Flow control)."""

    max_inflight_per_backend: int = Field(
        0, ge=0, description="a backend with this many open requests (every replica's) "
        "takes no more: new ones wait in the proxy for room, and the policy picks when "
        "they leave, among the backends with room. 0: off (every request is sent at once)")
    queue_timeout_s: float = Field(30.0, gt=0, description="a request waiting longer "
                                   "gets 503 `overloaded` with Retry-After")
    max_queued: int = Field(10_000, ge=1, description="requests waiting at most; one "
                            "more gets 503 `overloaded` at once (load shedding)")
    strict: bool = Field(True, description="with `state.backend: redis`, hold the limit "
                         "across the replicas at every moment: each replica opens requests "
                         "on a backend only within the slots it leased in Redis (renewed "
                         "every `state.sync_interval_s` and when a request finds none "
                         "free; atomic; README, Flow control). false: each counts the "
                         "others' open requests as of the last sync, so replicas that "
                         "refill at once pass the limit together (up to replicas x limit). "
                         "Nothing changes with one process (`state.backend: memory`)")
    priority_header: bool = Field(True, description="with `auth` off, a request's "
                                  "`x-laneway-priority: <int>` header (-10 to 10) sets "
                                  "its priority (higher leaves first); with `auth` on "
                                  "the key's `priority` does and the header is ignored")


class AdminConfig(_Section):
    """The admin API (proxy/http/admin.py; docs/security.md). Closed unless a token is set;
    only the token's SHA-256 is kept (`token` in the file or LANEWAY_ADMIN__TOKEN is
    hashed into `token_sha256` as the config loads)."""

    enabled: bool | None = Field(None, description="serve /admin/...; null: when a token "
                                 "is set; true without a token: the config is refused")
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="hex "
                                     "SHA-256 of the token /admin needs as `Authorization: "
                                     "Bearer <token>` (`laneway keys hash <token>`)")
    allowed_hosts: list[str] = Field(default_factory=list, description="`Host` names "
                                     "/admin answers besides loopback ones and "
                                     "server.host (DNS rebinding)")
    backend_allowlist: list[str] = Field(
        default_factory=list, description="networks (10.0.0.0/8) and host names "
        "(vllm-gpu0) whose backends POST /admin/backends may add; empty: none")
    policy_save_dir: str | None = Field(None, description="PUT /admin/policy may set "
                                        "qos_drl's `online_save` only under this "
                                        "directory; null: not at all")

    @model_validator(mode="before")
    @classmethod
    def _hash_token(cls, data: Any) -> Any:
        """Keep the token's hash only; an empty token (an unset env var) is none."""
        if not isinstance(data, dict) or "token" not in data:
            return data
        data = dict(data)
        token = data.pop("token")
        if token is not None and not isinstance(token, str):
            raise ValueError("admin.token must be a string")
        if token and token.strip():
            if data.get("token_sha256") is not None:
                raise ValueError("set admin.token or admin.token_sha256, not both")
            data["token_sha256"] = hash_key(token.strip())
        return data

    @model_validator(mode="after")
    def _closed_without_token(self) -> AdminConfig:
        if self.enabled and self.token_sha256 is None:
            raise ValueError("admin.enabled is true but no admin.token is set (an empty "
                             "one counts as none): the admin API would be open to "
                             "anyone who reaches the port. Set admin.token (or "
                             "LANEWAY_ADMIN__TOKEN), or admin.enabled: false")
        for entry in self.backend_allowlist:
            allowlist_entry(entry)
        return self

    @property
    def on(self) -> bool:
        return self.token_sha256 is not None and self.enabled is not False


class ApiKeyConfig(_Section):
    """One client key; only its SHA-256 is stored (`laneway keys hash <key>`)."""

    name: str = Field(min_length=1, description="who the key belongs to (logs, limits)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the key")
    models: list[str] = Field(default_factory=list, description="models the key may "
                              "use; empty: every model")
    requests_per_minute: int | None = Field(None, gt=0, description="null: unlimited")
    tokens_per_minute: int | None = Field(None, gt=0, description="prompt + completion "
                                          "tokens; null: unlimited")
    priority: int = Field(0, description="flow control: while backends are full, this "
                          "key's requests leave the proxy's queue before those of keys "
                          "with a lower priority")
    slo_class: str | None = Field(None, description="the SLO class (`slo_classes`) of "
                                  "this key's requests; null: `default_slo_class`")
    hints: bool = Field(False, description="honour this key's routing hints "
                        "(`x-laneway-slo-ms`, `x-laneway-expected-tokens`, "
                        "`x-laneway-budget`, `x-laneway-read-rate`); false: they are "
                        "ignored, since they buy a tighter SLO or a larger cost budget")


class SloClassConfig(_Section):
    """One SLO class (docs/slice.md, SLO classes in the proxy): what a backend running
    the SLICE scheduler is told about the class's requests, and what the class's
    metrics judge them by. Either `ttft_ms` (a non-real-time class) or `deadline_ms`
    (a real-time one)."""

    tpot_ms: float = Field(gt=0, description="time per output token the class needs "
                           "(ms; the SLICE scheduler's decode rate is 1000 / tpot_ms "
                           "tokens a second); met when the stream's mean TPOT is within")
    ttft_ms: float | None = Field(None, gt=0, description="time to first token (ms): met "
                                  "when the first token and the mean TPOT are within")
    deadline_ms: float | None = Field(None, gt=0, description="end-to-end deadline (ms), "
                                      "sent as what is left of it when the request (or a "
                                      "migrated continuation) is sent; met when the last "
                                      "byte is within")
    utility: float = Field(1.0, gt=0, description="the SLICE scheduler's utility U: a "
                           "class worth more is selected first when not all fit")
    priority: int = Field(0, description="vLLM's `priority` sent to `scheduler: slice` "
                          "and `scheduler: priority` backends: lower runs first")

    @model_validator(mode="after")
    def _one_latency_bound(self) -> SloClassConfig:
        if (self.ttft_ms is None) == (self.deadline_ms is None):
            raise ValueError("an SLO class sets either ttft_ms or deadline_ms")
        return self


class AuthConfig(_Section):
    """Client API keys and per-key limits (README, Auth and limits)."""

    enabled: bool = Field(False, description="require `Authorization: Bearer <key>`")
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    redis_keys: bool = Field(False, description="also accept keys stored in Redis "
                             "(hash <state.key_prefix>:apikeys; needs state.backend redis)")
    chars_per_token: float = Field(4.0, gt=0, description="prompt-token estimate charged "
                                   "up front (reconciled with usage at the end)")
    default_max_tokens: int = Field(256, gt=0, description="completion tokens charged up "
                                    "front (per choice) when a request sets no max_tokens "
                                    "and its model's context length is not known; when it "
                                    "is, what the model could generate (the context less "
                                    "the prompt), up to the key's tokens_per_minute, but "
                                    "never less than this (docs/security_limits.md)")

    @field_validator("keys")
    @classmethod
    def _unique_key_names(cls, keys: list[ApiKeyConfig]) -> list[ApiKeyConfig]:
        """A key's name keys its rate-limit counters (shared by replicas): two keys of
        one name would share their limits."""
        names = [k.name for k in keys]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate API key names: {', '.join(dupes)} (a name keys "
                             "its key's rate limits)")
        return keys


class StateConfig(_Section):
    """State shared between proxy replicas (README, Shared state)."""

    backend: Literal["memory", "redis"] = Field("memory", description="memory: this "
                                                "process only; redis: shared by replicas")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis://host:port/db")
    key_prefix: str = Field("laneway", min_length=1, description="prefix of every Redis key")
    sync_interval_s: float = Field(0.05, gt=0, description="replicate local state this often")
    inflight_ttl_s: float = Field(3.0, gt=0, description="a replica silent this long: its "
                                  "in-flight counts stop counting (crash)")
    log_max_entries: int = Field(10_000, gt=0, description="replication log length "
                                 "(prefix index, EMA speeds, stored responses' homes)")
    max_connections: int = Field(8, ge=1, description="Redis connection pool size")
    timeout_s: float = Field(0.5, gt=0, description="per Redis call; slower = Redis down")


class ResponsesConfig(_Section):
    """The Responses API's stored responses (README, API; proxy/http/stored_responses.py)."""

    remember: int = Field(100_000, ge=1, description="response ids whose backend this "
                          "replica remembers (least recently used out first)")
    lookup_timeout_s: float = Field(5.0, gt=0, description="asking the backends which "
                                    "holds a response id this replica does not remember")


class DebugConfig(_Section):
    log_decisions: bool = False
    allow_forced_migration: bool = Field(False, description="honour the request header "
                                         "`x-laneway-migrate-after: N` (tests, demos)")


class LengthPredictorConfig(_Section):
    """The MoE output-length predictor (README, Predictors); off without an artifact."""

    artifact: str | None = Field(None, description="directory written by `laneway train "
                                 "length`; null: no length predictions")
    model_map: dict[str, str] = Field(default_factory=dict, description="request model → "
                                      "predictor key (an expert model name or `any`)")
    fallback_key: str | None = Field("any", description="key for models neither mapped nor "
                                     "a key themselves; null: no prediction for them")


class TracingConfig(_Section):
    """OpenTelemetry traces over OTLP/HTTP (README, Tracing; proxy/observability/tracing.py);
    applied
    at start (a change needs a restart)."""

    otlp_endpoint: str | None = Field(
        None, description="the collector's OTLP/HTTP traces URL, e.g. "
        "http://otel-collector:4318/v1/traces (Jaeger, Tempo and the OpenTelemetry "
        "Collector take it); unset: no tracing")
    service_name: str = Field("laneway", min_length=1, description="the spans' "
                              "service.name")
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="share of new traces recorded; a request whose "
        "client sent a `traceparent` follows its sampled flag instead")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with each "
                                    "export, e.g. the collector's auth")
    timeout_s: float = Field(5.0, gt=0, description="one export's timeout, and the "
                             "longest flush at shutdown")
    export_interval_s: float = Field(1.0, gt=0, description="finished spans are sent "
                                     "this often (64 per export request)")
    max_queued_spans: int = Field(
        8192, ge=1, description="spans waiting for export; more are dropped (never "
        "the requests) while the collector is slow or down (an export that failed is "
        "dropped too: laneway_trace_spans_dropped_total)")


class PredictorsConfig(_Section):
    length: LengthPredictorConfig = LengthPredictorConfig()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LANEWAY_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    server: ServerConfig = ServerConfig()
    backends: list[BackendConfig] = Field(default_factory=list)
    model_groups: dict[str, list[str]] = Field(
        default_factory=dict, description="a request model naming several served models: "
        "the policy picks among all their backends and the upstream body names the "
        "picked backend's model (README, Model groups)")
    model_fallbacks: dict[str, list[str]] = Field(
        default_factory=dict, description="request model -> models (or groups) tried in "
        "order when none of its backends answered before the first byte: none healthy, "
        "or every attempt failed (README, Model fallbacks)")
    slo_classes: dict[str, SloClassConfig] = Field(
        default_factory=dict, description="SLO classes by name (docs/slice.md): a "
        "request's class is its key's `slo_class`, with `auth` off its "
        "`x-laneway-slo-class` header, else `default_slo_class`; empty: no classes")
    default_slo_class: str | None = Field(None, description="the class of a request "
                                          "that names none; required with slo_classes")
    policy: PolicyConfig = PolicyConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    poller: PollerConfig = PollerConfig()
    migration: MigrationConfig = MigrationConfig()
    outliers: OutliersConfig = OutliersConfig()
    admin: AdminConfig = AdminConfig()
    flow_control: FlowControlConfig = FlowControlConfig()
    predictors: PredictorsConfig = PredictorsConfig()
    auth: AuthConfig = AuthConfig()
    state: StateConfig = StateConfig()
    responses: ResponsesConfig = ResponsesConfig()
    tracing: TracingConfig = TracingConfig()
    debug: DebugConfig = DebugConfig()

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, backends: list[BackendConfig]) -> list[BackendConfig]:
        names = [b.name for b in backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate backend names: {', '.join(dupes)}")
        bound = [b.kv_events.endpoint for b in backends if b.kv_events and b.kv_events.bind]
        twice = sorted({e for e in bound if bound.count(e) > 1})
        if twice:
            raise ValueError(f"kv_events endpoints bound by two backends: {', '.join(twice)}")
        return backends

    @model_validator(mode="after")
    def _groups_name_models(self) -> Settings:
        served = {b.model for b in self.backends}
        for group, members in self.model_groups.items():
            if not members:
                raise ValueError(f"model group {group!r} names no model")
            if group in served:
                raise ValueError(f"model group {group!r} is also a served model name")
            nested = sorted(set(members) & set(self.model_groups))
            if nested:
                raise ValueError(f"model group {group!r} lists groups: {', '.join(nested)}")
        for model, fallbacks in self.model_fallbacks.items():
            if not fallbacks or model in fallbacks or len(set(fallbacks)) < len(fallbacks):
                raise ValueError(f"model_fallbacks of {model!r} must name other models, "
                                 "each once")
        return self

    @model_validator(mode="after")
    def _slo_classes_exist(self) -> Settings:
        classes = self.slo_classes
        for name in classes:
            if not _SLO_CLASS_NAME.fullmatch(name):
                raise ValueError(f"SLO class name {name!r} must match "
                                 f"{_SLO_CLASS_NAME.pattern} (it is a metric label)")
        if classes and self.default_slo_class is None:
            raise ValueError("default_slo_class is required with slo_classes")
        named: list[tuple[str, str | None]] = [("default_slo_class", self.default_slo_class)]
        named += [
            (f"auth.keys[{key.name}].slo_class", key.slo_class) for key in self.auth.keys]
        for where, chosen in named:
            if chosen is not None and chosen not in classes:
                raise ValueError(f"{where}: no SLO class {chosen!r} in slo_classes")
        for backend in self.backends:
            scheduler = backend.labels.get(SCHEDULER_LABEL)
            if scheduler is not None and scheduler not in SCHEDULERS:
                raise ValueError(f"backend {backend.name}: label {SCHEDULER_LABEL}: "
                                 f"{scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Env first so that LANEWAY_… overrides what the YAML file (init) says.
        return env_settings, init_settings


def load_settings(path: str | Path | None = None) -> Settings:
    """Load YAML (if given) + env into a validated `Settings`, or raise ConfigError."""
    return load_settings_and_policy(path)[0]


def load_settings_and_policy(path: str | Path | None = None) -> tuple[Settings, Policy]:
    """`load_settings`, and the policy its check built from `policy` (for a reload, which
    routes with it: a policy with models is built once)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    policy = _check_policy(settings)
    _check_predictors(settings)
    _check_tls(settings)
    return settings, policy


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path}: top level must be a mapping")
    return loaded


def _describe(exc: ValidationError, path: str | Path | None) -> str:
    where = f"config {path}" if path else "config"
    lines = [f"{where} is invalid:"]
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(root)"
        lines.append(f"  {key}: {err['msg']}")
    return "\n".join(lines)


def _check_policy(settings: Settings) -> Policy:
    from policies.base import FleetChecked, PolicyLoadError, UnknownPolicyError, build_policy

    try:
        policy = build_policy(settings.policy.name, settings.policy.params)
    except UnknownPolicyError as exc:
        raise ConfigError(f"policy.name: {exc}") from None
    except PolicyLoadError as exc:
        raise ConfigError(f"policy.params: {exc}") from None
    except ValidationError as exc:
        details = "; ".join(
            f"policy.params.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"config is invalid: {details}") from None
    if isinstance(policy, FleetChecked):  # (e.g. disco: backends on both sides)
        problem = policy.check_fleet([backend.labels for backend in settings.backends])
        if problem is not None:
            raise ConfigError(f"config is invalid: {problem}")
    return policy


def _check_tls(settings: Settings) -> None:
    try:
        check_server_tls(settings.server.tls_certfile, settings.server.tls_keyfile)
        upstream_context(settings.upstream.tls_ca_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_predictors(settings: Settings) -> None:
    """The length artifact is there and of a format this version reads (its meta only;
    the proxy loads the weights at start)."""
    from predictors.base import ArtifactError, check_length_artifact

    artifact = settings.predictors.length.artifact
    if artifact is not None:
        try:
            check_length_artifact(artifact)
        except ArtifactError as exc:
            raise ConfigError(f"predictors.length.artifact: {exc}") from None
