"""proxy/routing/block_hashes.py against vectors from vLLM 0.32's own code.

The vectors were computed once with `vllm.v1.core.kv_cache_utils.init_none_hash` and
`hash_block_tokens` (with `vllm.utils.hashing.sha256` / `sha256_cbor`), PYTHONHASHSEED
unset unless noted, extra keys as `generate_block_hash_extra_keys` builds them; the
real-server check is tests/integration/test_kv_events_vllm.py.
"""

from __future__ import annotations

import pytest

from proxy.routing.block_hashes import BlockHasher

# 64 tokens, 4 full blocks of 16; ids past 2**16 and 2**31 exercise pickle's and CBOR's
# wider integer encodings
TOKENS = ([t * 7919 % 50000 for t in range(40)] + [70000, 2**31 + 5] + list(range(22)))

VECTORS = {
    "sha256": {
        "plain": [0xc6b3b9a036f9c9ce, 0xdfabcc88f91b75d, 0x969ec15da6c43b73,
                  0x148ad943ec0c0271],
        "lora+salt": [0x64d64dcd18f8ab43, 0x9597e0a67393707c, 0x60f21d1c56a094e4,
                      0xb05bc2266168665],
        "seed=laneway": [0x34974f4f5289e4b9],
    },
    "sha256_cbor": {
        "plain": [0x4d0b3b5afe1426af, 0xcd36b2a40370feae, 0xb944f21bdae45923,
                  0x4ad02badfe7bfe7b],
        "lora+salt": [0xbce0de285e473ae4, 0xa53ab61136daf34b, 0x3cd2d82dbb594c50,
                      0xbc802049f5945567],
        "seed=laneway": [0xb22d75bad95f558f],
    },
}


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_chain_matches_vllm(algo: str) -> None:
    hasher = BlockHasher(algo, block_size=16)  # type: ignore[arg-type]
    assert hasher.chain(TOKENS) == VECTORS[algo]["plain"]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_lora_and_cache_salt_keys(algo: str) -> None:
    hasher = BlockHasher(algo)  # type: ignore[arg-type]
    chain = hasher.chain(TOKENS, lora=("ad1", "/p/ad1"), cache_salt="s1")
    assert chain == VECTORS[algo]["lora+salt"]
    assert chain[0] != hasher.chain(TOKENS, lora=("ad1", "/p/ad1"))[0]  # the salt counts


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_seed(algo: str) -> None:
    seeded = BlockHasher(algo, seed="laneway")  # type: ignore[arg-type]
    assert seeded.chain(TOKENS[:16]) == VECTORS[algo]["seed=laneway"]
    assert seeded.chain(TOKENS[:16]) != BlockHasher(algo).chain(TOKENS[:16])  # type: ignore[arg-type]


def test_only_full_blocks_and_a_prefix_shares_its_chain() -> None:
    hasher = BlockHasher("sha256", block_size=16)
    assert hasher.chain(TOKENS[:15]) == []
    assert hasher.chain(TOKENS[:47]) == VECTORS["sha256"]["plain"][:2]
    # a different block in the middle changes that block's hash and every later one
    changed = [*TOKENS[:20], 1, *TOKENS[21:]]
    assert hasher.chain(changed)[0] == VECTORS["sha256"]["plain"][0]
    assert all(a != b for a, b in zip(hasher.chain(changed)[1:],
                                      VECTORS["sha256"]["plain"][1:], strict=True))


def test_block_size_and_values_in_64_bits() -> None:
    chain = BlockHasher("sha256", block_size=8).chain(TOKENS)
    assert len(chain) == 8
    assert all(0 <= h < 2**64 for h in chain)
    assert chain[0] != VECTORS["sha256"]["plain"][0]


def test_unsupported_algorithm() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash")  # type: ignore[arg-type]
