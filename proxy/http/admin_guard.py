"""What the admin API checks before it acts (docs/security.md): the token, the site a
request comes from, the body's media type, and the backends and paths an admin may
name. The token is compared by its SHA-256 in constant time; `Host` and `Origin` keep a
browser page (CSRF, a rebound DNS name) from using an operator's network position."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.allowlist import backend_allowed
from proxy.errors import Forbidden, Unauthorized, UnsupportedMediaType
from proxy.hashing import hash_key

if TYPE_CHECKING:
    from proxy.config import AdminConfig, KvEventsConfig

_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})


def check_request(cfg: AdminConfig, server_host: str, headers: dict[str, str]) -> None:
    """Raise unless the request names a host this proxy is known by, comes from no other
    origin, and carries the admin token."""
    host = headers.get("host", "")
    known = _LOOPBACK | {_hostname(h) for h in cfg.allowed_hosts} \
        | ({server_host.lower()} - _ANY_ADDRESS)
    if _hostname(host) not in known:
        raise Forbidden("The admin API does not answer to this host name "
                        "(admin.allowed_hosts).")
    origin = headers.get("origin")
    if origin is not None and origin.partition("://")[2].lower() != host.lower():
        raise Forbidden("The admin API takes no cross-origin requests.")
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if cfg.token_sha256 is None or scheme.lower() != "bearer" or not given.strip() \
            or not hmac.compare_digest(hash_key(given.strip()), cfg.token_sha256):
        raise Unauthorized("The admin API needs `Authorization: Bearer <admin.token>`.")


def check_body_type(headers: dict[str, str], body: bytes) -> None:
    """A body only as JSON: a browser's cross-site "simple" POST (text/plain, a form)
    cannot be one without a preflight."""
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if body.strip() and media != "application/json":
        raise UnsupportedMediaType("An admin request's body must be sent as "
                                   "`Content-Type: application/json`.")


def check_save_path(cfg: AdminConfig, path: Any) -> None:
    """A policy that writes a file (qos_drl's `online_save`) writes it only under
    `admin.policy_save_dir`: the admin API must not write anywhere the proxy may."""
    if path is None:
        return
    root = None if cfg.policy_save_dir is None else Path(cfg.policy_save_dir).resolve()
    if root is None or not isinstance(path, str) \
            or not Path(root, path).resolve().is_relative_to(root):
        raise Forbidden("`online_save` must be a path under admin.policy_save_dir "
                        f"({cfg.policy_save_dir or 'not set: no file may be written'}).",
                        param="params")


def check_backend(cfg: AdminConfig, url: str, host: str) -> None:
    """Only a backend whose host `admin.backend_allowlist` lists may be added."""
    if not backend_allowed(cfg.backend_allowlist, url):
        raise Forbidden(f"The admin API may not add a backend at {host}: not in "
                        "admin.backend_allowlist.", param="url")


def check_kv_events(cfg: AdminConfig, kv_events: KvEventsConfig | None) -> None:
    """An added backend's KV events come only from hosts `admin.backend_allowlist`
    lists, over TCP, to a socket the proxy connects (binding one, which whoever reaches
    it can feed forged events, is the config file's decision)."""
    if kv_events is None:
        return
    if kv_events.bind:
        raise Forbidden("The admin API may not make the proxy bind a KV events socket "
                        "(kv_events.bind); set it in the config file.", param="kv_events")
    for endpoint in (kv_events.endpoint, kv_events.replay_endpoint):
        if endpoint is not None and not (endpoint.startswith("tcp://")
                                         and backend_allowed(cfg.backend_allowlist, endpoint)):
            raise Forbidden(f"The admin API may not follow KV events at {endpoint[:80]}: "
                            "not a tcp:// address in admin.backend_allowlist.",
                            param="kv_events")


def _hostname(host: str) -> str:
    """`Host` without its port, lower case (`[::1]:8000` -> `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host
