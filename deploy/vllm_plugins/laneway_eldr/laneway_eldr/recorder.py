"""Per-request expert counts from the router's top-k ids, kept per KV block.

Pure numpy, no vLLM: the hooks feed it one model step at a time.

A prefill token at position p belongs to KV block p // block_size. Each full block is
keyed by a chained hash of the prompt's token ids up to its end (the same identity a
prefix-cache hit has), and its counts are kept in a bounded signature cache. A
request's signature is the sum over its blocks: blocks it computed itself, and blocks
that vLLM took from the prefix cache (never routed in this request) from the
signature cache -- so the signature is the same with or without a cache hit.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_BATCH_BUCKET = 64


def block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (a prefix's hashes are a prefix)."""
    hashes: list[bytes] = []
    parent = b""
    for end in range(block_size, len(prompt_token_ids) + 1, block_size):
        tokens = np.asarray(prompt_token_ids[end - block_size:end], dtype=np.int64)
        parent = hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def external_id(internal_id: str) -> str:
    """The client's `X-Request-Id` in vLLM's internal id.

    The API server makes `cmpl-<id>-<prompt index>` (completions) or `chatcmpl-<id>`,
    and the engine appends `-<8 hex>`.
    """
    head, _, tail = internal_id.rpartition("-")
    if head and len(tail) == 8:
        internal_id = head
    prefix, _, rest = internal_id.partition("-")
    if prefix == "cmpl":
        head, _, index = rest.rpartition("-")
        return head if head and index.isdigit() else rest
    return rest if prefix == "chatcmpl" and rest else internal_id


@dataclass
class _Request:
    prompt_len: int
    hashes: list[bytes]
    own: np.ndarray  # [blocks, layers, experts] counts computed in this request
    decode: np.ndarray  # [layers, experts] decode-token counts
    first_computed: int = -1  # first position this request routed itself
    record: dict[str, Any] = field(default_factory=dict)


class ExpertRecorder:
    """Counts for one model process; `lookup`/`metrics_text` are thread-safe."""

    def __init__(self, layers: int, experts: int, block_size: int,
                 cache_blocks: int = 65_536, keep_requests: int = 4096) -> None:
        self.layers, self.experts, self.block_size = layers, experts, block_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_blocks, self._keep = cache_blocks, keep_requests
        self._live: dict[str, _Request] = {}
        self._done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._step: dict[int, np.ndarray] | None = None
        self._lock = threading.Lock()
        self.decode_steps = 0
        self.decode_tokens = 0
        self.active_experts_sum = 0.0  # sum over steps of mean-per-layer distinct experts
        # The same split by decode batch size (a union grows with the batch, so
        # policies are compared at equal batch sizes); the last bucket is "or more".
        self.steps_by_batch = np.zeros(MAX_BATCH_BUCKET + 1, np.int64)
        self.active_by_batch = np.zeros(MAX_BATCH_BUCKET + 1)

    # -- feeding ---------------------------------------------------------------------

    def new_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        blocks = -(-len(prompt_token_ids) // self.block_size)
        self._live[req_id] = _Request(
            len(prompt_token_ids), block_hashes(prompt_token_ids, self.block_size),
            np.zeros((blocks, self.layers, self.experts), np.int32),
            np.zeros((self.layers, self.experts), np.int32))

    def restart(self, req_id: str) -> None:
        """A preempted request resumes: vLLM recomputes its prompt, count it afresh."""
        state = self._live.get(req_id)
        if state is not None:
            state.own[:] = 0
            state.first_computed = -1

    def begin_step(self) -> None:
        self._step = {}

    def capture(self, layer: int, topk_ids: np.ndarray) -> None:
        if self._step is not None:
            self._step[layer] = topk_ids

    def end_step(self, batch: Iterable[tuple[str, int, int]]) -> None:
        """`batch`: (request id, computed tokens before the step, tokens this step),
        in the order the step's token rows were laid out."""
        step, self._step = self._step, None
        if not step or len(step) != self.layers:
            return
        ids = np.stack([step[layer] for layer in range(self.layers)])  # [L, T, k]
        union = np.zeros((self.layers, self.experts), bool)
        offset, decode_tokens = 0, 0
        for req_id, computed, count in batch:
            state = self._live.get(req_id)
            rows = ids[:, offset:offset + count]
            offset += count
            if state is not None:
                decode_tokens += self._add(req_id, state, computed, rows, union)
        if decode_tokens:
            active = float(union.sum(axis=1).mean())
            self.decode_steps += 1
            self.decode_tokens += decode_tokens
            self.active_experts_sum += active
            bucket = min(decode_tokens, MAX_BATCH_BUCKET)
            self.steps_by_batch[bucket] += 1
            self.active_by_batch[bucket] += active

    def finish(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._live.pop(req_id, None)

    def _add(self, req_id: str, state: _Request, computed: int, rows: np.ndarray,
             union: np.ndarray) -> int:
        positions = computed + np.arange(rows.shape[1])
        prefill = positions < state.prompt_len
        layer_index = np.arange(self.layers)[:, None, None]
        if prefill.any():
            if state.first_computed < 0:
                state.first_computed = int(positions[0])
            block = (positions[prefill] // self.block_size)[None, :, None]
            np.add.at(state.own, (block, layer_index, rows[:, prefill]), 1)
            if positions[-1] >= state.prompt_len - 1:
                self._finalize(req_id, state)
        decode_rows = rows[:, ~prefill]
        if decode_rows.shape[1]:
            np.add.at(state.decode, (layer_index, decode_rows), 1)
            union[layer_index[:, :, 0], decode_rows.reshape(self.layers, -1)] = True
        return int(decode_rows.shape[1])

    def _finalize(self, req_id: str, state: _Request) -> None:
        signature = state.own.sum(axis=0)
        missing = 0
        with self._lock:
            for b, digest in enumerate(state.hashes):
                cached = self._cache.get(digest)
                if b * self.block_size >= state.first_computed:  # routed here in full
                    self._cache[digest] = state.own[b].copy()
                elif cached is not None:  # a prefix-cache hit: counts of an earlier request
                    signature += cached - state.own[b]
                else:
                    missing += 1
                    continue
                self._cache.move_to_end(digest)
            while len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
            state.record = {"prompt_tokens": state.prompt_len, "prefill": signature,
                            "decode": state.decode, "complete": missing == 0,
                            "cached_tokens": max(state.first_computed, 0)}
            self._done[external_id(req_id)] = state.record
            while len(self._done) > self._keep:
                self._done.popitem(last=False)

    # -- reading (side endpoint thread) ----------------------------------------------

    def lookup(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._done.get(request_id)
            if record is not None:
                return {"request_id": request_id, "layers": self.layers,
                        "experts": self.experts, "block_size": self.block_size,
                        **{k: (v.tolist() if isinstance(v, np.ndarray) else v)
                           for k, v in record.items()}}
        return None

    def metrics_text(self) -> str:
        by_batch = "".join(
            f'laneway_eldr_decode_steps_by_batch{{batch="{b}"}} {self.steps_by_batch[b]}\n'
            f'laneway_eldr_decode_active_experts_by_batch_sum{{batch="{b}"}} '
            f"{self.active_by_batch[b]}\n"
            for b in np.flatnonzero(self.steps_by_batch))
        return by_batch + (
            "# TYPE laneway_eldr_decode_steps_total counter\n"
            f"laneway_eldr_decode_steps_total {self.decode_steps}\n"
            "# TYPE laneway_eldr_decode_tokens_total counter\n"
            f"laneway_eldr_decode_tokens_total {self.decode_tokens}\n"
            "# HELP laneway_eldr_decode_active_experts_sum distinct experts per decode "
            "step (mean over MoE layers), summed over steps\n"
            "# TYPE laneway_eldr_decode_active_experts_sum counter\n"
            f"laneway_eldr_decode_active_experts_sum {self.active_experts_sum}\n"
            "# TYPE laneway_eldr_experts gauge\n"
            f"laneway_eldr_experts {self.experts}\n")
