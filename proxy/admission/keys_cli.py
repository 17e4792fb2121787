"""`laneway keys`: make client API keys; only their SHA-256 goes into config or Redis.

    laneway keys new                      print a fresh key and its sha256
    laneway keys hash sk-...              print the sha256 of a key (for auth.keys)
    laneway keys add --redis-url URL --name team-a [--models m1,m2] [--rpm N] [--tpm N]
                                          store a fresh key's hash in Redis, print the key
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from typing import Any

import orjson

from proxy.hashing import hash_key


def _new(args: argparse.Namespace) -> int:
    key = f"sk-lw-{secrets.token_urlsafe(32)}"
    print(f"key:    {key}\nsha256: {hash_key(key)}")
    return 0


def _hash(args: argparse.Namespace) -> int:
    print(hash_key(args.key))
    return 0


def _add(args: argparse.Namespace) -> int:
    import redis.asyncio as aioredis

    key = f"sk-lw-{secrets.token_urlsafe(32)}"
    entry: dict[str, Any] = {"name": args.name,
                             "models": [m for m in (args.models or "").split(",") if m],
                             "requests_per_minute": args.rpm, "tokens_per_minute": args.tpm,
                             "priority": args.priority, "slo_class": args.slo_class,
                             "hints": args.hints}

    async def store() -> None:
        client = aioredis.Redis.from_url(args.redis_url)
        try:
            await client.hset(f"{args.key_prefix}:apikeys", hash_key(key), orjson.dumps(entry))
        finally:
            await client.aclose()

    asyncio.run(store())
    print(f"key for {args.name} (shown once): {key}")
    return 0


def add_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("keys", help="client API keys (auth)")
    sub = parser.add_subparsers(dest="keys_command", required=True)
    sub.add_parser("new", help="a fresh key and its sha256").set_defaults(func=_new)
    hash_cmd = sub.add_parser("hash", help="sha256 of a key, for auth.keys[].sha256")
    hash_cmd.add_argument("key")
    hash_cmd.set_defaults(func=_hash)
    add = sub.add_parser("add", help="store a fresh key's hash in Redis (auth.redis_keys)")
    add.add_argument("--redis-url", required=True)
    add.add_argument("--key-prefix", default="laneway", help="= state.key_prefix")
    add.add_argument("--name", required=True)
    add.add_argument("--models", help="comma-separated; default: every model")
    add.add_argument("--rpm", type=int, help="requests per minute")
    add.add_argument("--tpm", type=int, help="tokens per minute")
    add.add_argument("--priority", type=int, default=0,
                     help="flow control: higher leaves the queue first (default 0)")
    add.add_argument("--slo-class", help="its requests' SLO class (default: "
                     "default_slo_class)")
    add.add_argument("--hints", action="store_true", help="honour its routing-hint "
                     "headers (x-laneway-slo-ms, -expected-tokens, -budget, -read-rate)")
    add.set_defaults(func=_add)
