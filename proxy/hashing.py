"""The one hash laneway keeps of a secret: client API keys and the admin token are stored
and compared as their SHA-256, so neither the config nor Redis holds a usable key."""

from __future__ import annotations

import hashlib


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
