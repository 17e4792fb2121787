"""The set of backends, their latest stats snapshot and exact in-flight counts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from proxy.types import Backend, BackendStats, ClusterView

log = logging.getLogger("laneway")


class Registry:
    """Backends by name and model.

    A backend serves its configured `model` and the other names its `/v1/models`
    lists (LoRA adapters, extra served names: `set_served`, from proxy/fleet/discovery.py).
    A model group (`model_groups` in the config) is a request model whose candidates
    are the healthy backends of every member model, in member order. With `panic`,
    a model (or group) none of whose scraped, non-draining backends is healthy has
    those as candidates (`poller.route_when_all_unhealthy`): a group with a healthy
    member never routes to an unhealthy one.
    `stats` is replaced wholesale by `publish` (the poller's snapshot), so readers
    may hold on to it. The healthy candidates per model are derived once per
    snapshot, not once per request.
    """

    def __init__(self, backends: Iterable[Backend],
                 groups: Mapping[str, Iterable[str]] | None = None, *,
                 panic: bool = False) -> None:
        self._backends: dict[str, Backend] = {}
        self._panic = panic
        self.panicking: frozenset[str] = frozenset()  # models and groups in panic mode
        self._groups: dict[str, tuple[str, ...]] = {}
        # Open requests per backend: via this proxy (`local_inflight`), and via every
        # replica (`inflight`, what policies see: local + the others' counts from the
        # shared state's last sync). Both are plain dicts updated in place, so a
        # policy's lookup stays one C-level dict access.
        self._local: dict[str, int] = {}
        self._remote: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self.local_inflight: Mapping[str, int] = MappingProxyType(self._local)
        self.inflight: Mapping[str, int] = MappingProxyType(self._inflight)
        self.stats: Mapping[str, BackendStats] = MappingProxyType({})
        self._draining: set[str] = set()
        self._extra: dict[str, frozenset[str]] = {}  # backend -> names besides its model
        self._unlisted: set[str] = set()  # backends whose /v1/models omits their model
        self._context: dict[str, int] = {}  # backend -> max_model_len, once listed
        self._served: frozenset[str] = frozenset()  # models and groups a backend serves
        self._healthy_by_model: dict[str, tuple[Backend, ...]] = {}
        self._membership_changed = False  # since the last `update`
        self.on_release: Callable[[str], None] | None = None  # a request left a backend
        for backend in backends:
            self.add(backend)
        self.set_groups(groups or {})

    # -- membership -------------------------------------------------------------
    def add(self, backend: Backend) -> None:
        if backend.name in self._backends:
            raise ValueError(f"backend {backend.name!r} already registered")
        self._backends[backend.name] = backend
        self._local.setdefault(backend.name, 0)
        self._inflight.setdefault(backend.name, self._remote.get(backend.name, 0))
        self._rederive()

    def remove(self, name: str) -> Backend:
        backend = self._backends.pop(name)
        self._draining.discard(name)
        self._extra.pop(name, None)
        self._unlisted.discard(name)
        self._context.pop(name, None)
        self._membership_changed = True
        self._rederive()
        return backend

    def set_served(self, name: str, models: Iterable[str], own: bool = True) -> bool:
        """`name` serves `models` besides its configured model (what its `/v1/models`
        lists), and its configured model only if `own` (False: its list omits it, so
        vLLM would answer every request for it with a 404: a server restarted with
        another model); True when that changed."""
        backend = self._backends.get(name)
        if backend is None:
            return False
        extra = frozenset(models) - {backend.model}
        if extra == self._extra.get(name, frozenset()) and (not own) == (name in self._unlisted):
            return False
        if not own and name not in self._unlisted:
            log.warning("backend %s does not serve its configured model %s (its /v1/models "
                        "lists %s): no requests for %s go there until it does", name,
                        backend.model, ", ".join(sorted(extra)) or "nothing", backend.model)
            self._unlisted.add(name)
        elif own and name in self._unlisted:
            log.info("backend %s serves its configured model %s again", name, backend.model)
            self._unlisted.discard(name)
        if extra != self._extra.get(name, frozenset()):
            log.info("backend %s serves %s", name, ", ".join(self._names(backend)))
        self._extra[name] = extra
        self._rederive()
        return True

    def _names(self, backend: Backend) -> tuple[str, ...]:
        """The models `backend` takes requests for: its configured one (unless its list
        omits it) and the other names it lists."""
        extra = sorted(self._extra.get(backend.name, ()))
        return tuple(extra) if backend.name in self._unlisted else (backend.model, *extra)

    def set_context(self, name: str, tokens: int | None) -> None:
        """Backend `name`'s context length (`max_model_len`), when its list has one."""
        if tokens is not None and name in self._backends:
            self._context[name] = tokens

    def context_of(self, name: str) -> int | None:
        return self._context.get(name)

    def model_context(self, model: str) -> int | None:
        """The context length a request for `model` (or group) fits wherever it goes:
        the smallest of its healthy backends' that are known."""
        known = [self._context[b.name] for b in self._healthy_by_model.get(model, ())
                 if b.name in self._context]
        return min(known, default=None)

    def served_by(self, name: str) -> frozenset[str]:
        """Every model name backend `name` serves: its configured model and the names its
        `/v1/models` listed."""
        return frozenset(self._names(self._backends[name]))

    def model_on(self, backend: Backend, requested: str) -> str:
        """The model a request for `requested` names on `backend`: `requested` when the
        backend serves it (its model, a LoRA adapter), else the first member of the
        group `requested` that the backend serves, else the backend's model."""
        extra = self._extra.get(backend.name, frozenset())
        if requested == backend.model or requested in extra:
            return requested
        for member in self._groups.get(requested, ()):
            if member == backend.model or member in extra:
                return member
        return backend.model

    def set_groups(self, groups: Mapping[str, Iterable[str]]) -> None:
        self._groups = {g: tuple(members) for g, members in groups.items()}
        self._rederive()

    def drain(self, name: str) -> None:
        """Stop routing new requests to `name`; open ones finish where they are."""
        if name not in self._backends:
            raise KeyError(name)
        self._draining.add(name)
        self._rederive()

    def undrain(self, name: str) -> None:
        if name not in self._backends:
            raise KeyError(name)
        self._draining.discard(name)
        self._rederive()

    def is_draining(self, name: str) -> bool:
        return name in self._draining

    def all(self) -> tuple[Backend, ...]:
        return tuple(self._backends.values())

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def serves(self, model: str) -> bool:
        """Whether any configured backend (healthy or not) serves `model`, or a member
        of the group `model`."""
        return model in self._served

    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as its model: the backends' models and the
        groups (healthy or not; LoRA adapters are not counted)."""
        return tuple(sorted({b.model for b in self._backends.values()} | set(self._groups)))

    def names_for(self, model: str) -> tuple[str, ...]:
        """`model` and the groups that list it: the names a request for it may use."""
        return (model, *(g for g, members in self._groups.items() if model in members))

    def healthy_models(self) -> list[str]:
        """Models (and groups) with a healthy backend: panic mode does not count."""
        return sorted(m for m, backends in self._healthy_by_model.items()
                      if backends and m not in self.panicking)

    # -- load signals ----------------------------------------------------------
    def publish(self, stats: Mapping[str, BackendStats]) -> None:
        self.stats = MappingProxyType(dict(stats))
        self._rederive()

    def update(self, changed: Mapping[str, BackendStats]) -> None:
        """Replace the snapshot with one where `changed` (of configured backends) is
        new. The candidates are re-derived only when someone's health changed: the
        poller publishes every few ms at 512 backends."""
        old = self.stats
        fresh = {k: v for k, v in changed.items() if k in self._backends}
        merged = {**old, **fresh}
        if self._membership_changed:  # drop removed backends (a re-added name keeps its)
            merged = {k: v for k, v in merged.items() if k in self._backends}
        self.stats = MappingProxyType(merged)
        if self._membership_changed or any(
                k not in old or old[k].healthy != v.healthy for k, v in fresh.items()):
            self._membership_changed = False
            self._rederive()

    def is_healthy(self, name: str) -> bool:
        stats = self.stats.get(name)
        return stats is not None and stats.healthy

    def view(self, model: str, now: float, exclude: Iterable[str] = ()) -> ClusterView:
        candidates = self._healthy_by_model.get(model, ())
        if exclude:
            excluded = set(exclude)
            candidates = tuple(b for b in candidates if b.name not in excluded)
        return ClusterView(candidates, self.stats, self.inflight, now)

    @contextmanager
    def guard(self, name: str) -> Iterator[None]:
        """Count one open request on `name` for the lifetime of the block."""
        self._local[name] = self._local.get(name, 0) + 1
        self._inflight[name] = self._inflight.get(name, 0) + 1
        try:
            yield
        finally:
            self._local[name] -= 1
            self._inflight[name] -= 1
            if self.on_release is not None:
                self.on_release(name)

    def set_remote_inflight(self, counts: Mapping[str, int]) -> None:
        """Other replicas' open requests per backend (from the shared state)."""
        self._remote = dict(counts)
        for name in set(self._inflight) | set(counts):
            self._inflight[name] = self._local.get(name, 0) + self._remote.get(name, 0)

    def _rederive(self) -> None:
        healthy: dict[str, list[Backend]] = {}
        scraped: dict[str, list[Backend]] = {}  # not draining, health known
        for backend in self._backends.values():
            models = self._names(backend)
            buckets = [healthy.setdefault(model, []) for model in models]
            if backend.name in self._draining or backend.name not in self.stats:
                continue
            for model in models:
                scraped.setdefault(model, []).append(backend)
            if self.stats[backend.name].healthy:
                for bucket in buckets:
                    bucket.append(backend)
        for group, members in self._groups.items():  # a backend once, at its first member
            healthy[group] = list({b.name: b for m in members for b in healthy.get(m, ())}
                                  .values())
            scraped[group] = list({b.name: b for m in members for b in scraped.get(m, ())}
                                  .values())
        served = {m for b in self._backends.values()
                  for m in (b.model, *self._extra.get(b.name, ()))}
        self._served = frozenset(served | {g for g, members in self._groups.items()
                                           if not served.isdisjoint(members)})
        panicking = {k for k, bs in healthy.items() if self._panic and not bs and scraped.get(k)}
        for key in sorted((panicking ^ self.panicking) & healthy.keys()):
            if key in panicking:
                log.warning("every backend of model %s is unhealthy: routing among all %d "
                            "anyway (panic mode) until one is healthy", key,
                            len(scraped[key]))
            else:
                log.info("model %s has a healthy backend again: panic mode off", key)
        self.panicking = frozenset(panicking)
        self._healthy_by_model = {k: tuple(scraped[k] if k in panicking else bs)
                                  for k, bs in healthy.items()}
