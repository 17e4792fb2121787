"""Change a running proxy: backends, policy, and a config reload (SIGHUP or admin).

Sections that take effect at once on reload: backends (added, removed after their
tracked streams were asked to move, or replaced when url/model/labels/api_key changed),
model groups and fallbacks, policy (name or params), auth, admin, debug, migration,
flow control, outliers.
Others (server, upstream, poller, state, predictors) are logged as needing a restart and
keep their old values.

A policy switch replaces the router; outcomes of requests picked by the previous
policy then reach the new one, which ignores requests it did not pick (every policy
either keys its bookkeeping by request id or keeps none per request).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from policies.base import Policy
from proxy.config import ConfigError, KvEventsConfig, Settings, load_settings_and_policy
from proxy.routing.router import Router
from proxy.runtime import Runtime, backends_from
from proxy.types import Backend

log = logging.getLogger("laneway.admin")
HOT_SECTIONS = ("backends", "model_groups", "model_fallbacks", "policy", "auth", "admin",
                "debug", "migration", "flow_control", "outliers")


def switch_policy(rt: Runtime, name: str, params: dict[str, Any], policy: Policy) -> None:
    """Route with `policy` (built from `name` and `params`, off the event loop, by the
    caller) from the next request on."""
    rt.replace_router(Router(policy, rt.metrics,
                             log_decisions=rt.settings.debug.log_decisions,
                             model_on=rt.registry.model_on, tls=rt.tls, kv=rt.kv))
    policy_cfg = rt.settings.policy.model_copy(update={"name": name, "params": params})
    rt.settings = rt.settings.model_copy(update={"policy": policy_cfg})
    log.info("policy switched to %s %s", name, params)


def add_backend(rt: Runtime, backend: Backend, kv_events: KvEventsConfig | None = None) -> None:
    """Raises ValueError if the name is taken; the poller scrapes it from its next round,
    and its KV events (if any) are followed from now on."""
    rt.registry.add(backend)
    rt.kv.add(backend.name, kv_events)
    log.info("backend %s (%s, %s) added", backend.name, backend.url, backend.model)


def remove_backend(rt: Runtime, name: str, migrate: bool = True) -> int:
    """Stop routing to `name`, ask its tracked streams to move, forget it. Streams that
    cannot move finish where they are. Returns how many streams were asked to move."""
    rt.registry.drain(name)
    moving = rt.streams.move_all(name, "drain") if migrate else 0
    rt.registry.remove(name)
    rt.poller.forget(name)
    rt.outliers.forget(name)
    rt.kv.remove(name)
    log.info("backend %s removed; %d tracked streams asked to move", name, moving)
    return moving


def apply_settings(rt: Runtime, new: Settings, policy: Policy) -> dict[str, Any]:
    """Apply what can change at runtime (`policy`: `new.policy` already built, used if
    it changed); returns what changed and what needs a restart."""
    old = rt.settings
    changes: dict[str, Any] = _apply_backends(rt, backends_from(new),
                                              {b.name: b.kv_events for b in new.backends})
    if new.model_groups != old.model_groups:
        rt.registry.set_groups(new.model_groups)
        changes["model_groups"] = sorted(new.model_groups)
    if new.policy != old.policy:
        switch_policy(rt, new.policy.name, dict(new.policy.params), policy)
        changes["policy"] = new.policy.name
    if new.auth != old.auth:
        rt.auth.reload(new.auth)
        changes["auth"] = True
    rt.settings = rt.settings.model_copy(update={s: getattr(new, s) for s in HOT_SECTIONS})
    restart = [s for s in Settings.model_fields
               if s not in HOT_SECTIONS and getattr(old, s) != getattr(new, s)]
    if restart:
        log.warning("config sections %s changed; they apply after a restart", restart)
    changes["needs_restart"] = restart
    return changes


def _apply_backends(rt: Runtime, wanted: list[Backend],
                    kv_events: dict[str, KvEventsConfig | None]) -> dict[str, Any]:
    current = {b.name: b for b in rt.registry.all()}
    target = {b.name: b for b in wanted}
    changed = [n for n in target.keys() & current.keys()
               if _identity(target[n]) != _identity(current[n])
               or kv_events.get(n) != rt.kv.config_of(n)]
    removed = sorted(current.keys() - target.keys())
    for name in removed + changed:
        remove_backend(rt, name)
    added = sorted(target.keys() - current.keys())
    for name in added + changed:
        add_backend(rt, target[name], kv_events.get(name))
    return {"added": added, "removed": removed, "replaced": sorted(changed)}


def _identity(backend: Backend) -> tuple[Any, ...]:
    """What replaces a backend when it changes (a new key too: its streams move)."""
    return backend.url, backend.model, dict(backend.labels), backend.api_key


async def reload_config(rt: Runtime, path: str | Path) -> dict[str, Any]:
    """Re-read the config file (and env) and apply it; a bad file changes nothing.

    Reading and checking the file builds its policy, which a changed policy then routes
    with: for a policy with models (qos_drl's checkpoint and encoder) that is ~0.4 s,
    so it runs in a worker thread and the streams the proxy relays keep flowing; only
    the swap runs on the event loop."""
    try:
        new, policy = await asyncio.to_thread(load_settings_and_policy, path)
    except ConfigError as exc:
        log.error("config reload rejected, keeping the running config: %s", exc)
        raise
    changes = apply_settings(rt, new, policy)
    log.info("config reloaded from %s: %s", path, changes)
    return changes


_reloads: set[asyncio.Task[None]] = set()  # SIGHUP reloads running (kept referenced)


def install_sighup(rt: Runtime, path: str | Path) -> None:
    """Reload `path` on SIGHUP (the usual daemon convention)."""
    async def reload() -> None:
        try:
            await reload_config(rt, path)
        except ConfigError:
            pass  # logged; the running config stays

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(reload())
        _reloads.add(task)
        task.add_done_callback(_reloads.discard)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)


def remove_sighup() -> None:
    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
