"""State shared between proxy replicas: in-memory (default) or Redis."""

from __future__ import annotations

import os
import socket

from proxy.config import StateConfig
from proxy.state.base import Inbox, Leasing, Outbox, Store, StoreUnavailable
from proxy.state.memory import MemoryStore

__all__ = ["Inbox", "Leasing", "MemoryStore", "Outbox", "Store", "StoreUnavailable", "build_store",
           "new_replica_id"]


def new_replica_id() -> str:
    """Unique per process, readable in Redis: host, pid and a random tail."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def build_store(cfg: StateConfig, replica_id: str) -> Store:
    if cfg.backend == "redis":
        from proxy.state.redis_store import RedisStore  # only Redis users need the client

        return RedisStore(cfg, replica_id)
    return MemoryStore()
