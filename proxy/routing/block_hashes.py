"""vLLM's prefix-cache block hashes, recomputed from a prompt's token ids.

vLLM names every full block of `block_size` tokens by a chain: the hash of
`(parent, tuple(block_token_ids), extra_keys)`, where the first block's parent is the
hash of the seed (vllm/v1/core/kv_cache_utils.py:160-172, 695-725). The seed is
PYTHONHASHSEED if the server has it set, else "vllm-none-hash" (kv_cache_utils.py:
122, 131-144). `sha256` hashes the pickle of that tuple (protocol
HIGHEST_PROTOCOL, 5 since Python 3.8), `sha256_cbor` its canonical CBOR
(vllm/utils/hashing.py:26-60); the parent inside the tuple is the whole 32-byte
digest, the KV events carry only its low 64 bits (kv_cache_utils.py:96-99).

Extra keys enter the hash too (kv_cache_utils.py:578-663): a LoRA adapter as
`("lora", name, path)` on every block, a `cache_salt` as `("cache_salt", salt)` on
the first block only, after the LoRA key. Multimodal inputs and prompt embeddings
are not recomputed here: their blocks' hashes will not match, which only costs a
missed hit. The xxhash algorithms use a random per-process seed unless
PYTHONHASHSEED is set, so they are not supported.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"
# vLLM pickles with pickle.HIGHEST_PROTOCOL of *its* interpreter: 5 on 3.8 to 3.14.
# Pinned so that a newer Python here cannot silently change every hash.
PICKLE_PROTOCOL = 5
_LOW_64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_ALGOS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """How one backend hashes its blocks: `--prefix-caching-hash-algo`, its block
    size (`--block-size`; 128 by default on CPU, 16 on most GPUs), and its
    PYTHONHASHSEED verbatim, e.g. "4242" (None: unset, vLLM's fixed default)."""

    algo: HashAlgo = "sha256"
    block_size: int = 16
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.algo not in _ALGOS:
            raise ValueError(f"unsupported prefix-caching hash algorithm {self.algo!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")

    def chain(self, token_ids: Sequence[int], lora: tuple[str, str] | None = None,
              cache_salt: str | None = None) -> list[int]:
        """The low 64 bits of the hash of every full block of `token_ids`, in order.
        `lora` is the adapter's (name, path) as the server loaded it."""
        digest = _ALGOS[self.algo]
        parent = digest(DEFAULT_SEED if self.seed is None else self.seed)
        lora_keys: tuple[tuple[str, ...], ...] = (("lora", *lora),) if lora else ()
        hashes: list[int] = []
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            salt_keys = (("cache_salt", cache_salt),) if cache_salt and start == 0 else ()
            extra_keys = (lora_keys + salt_keys) or None
            block = tuple(token_ids[start:start + self.block_size])
            parent = digest((parent, block, extra_keys))
            hashes.append(int.from_bytes(parent, "big") & _LOW_64)
        return hashes
