"""The ELDR plugin's recorder, fed synthetic steps (no vLLM)."""

from __future__ import annotations

import numpy as np
from laneway_eldr.recorder import ExpertRecorder, block_hashes, external_id

LAYERS, EXPERTS, BLOCK = 2, 8, 4


def routed(positions: range, prompt: list[int]) -> np.ndarray:
    """Deterministic top-2 ids per (layer, token): a function of the token id."""
    tokens = np.array([prompt[p] for p in positions])
    return np.stack([np.stack([(tokens + layer) % EXPERTS, (tokens * 3 + layer) % EXPERTS], 1)
                     for layer in range(LAYERS)])


def run_prefill(rec: ExpertRecorder, req_id: str, prompt: list[int], computed: int) -> None:
    rec.new_request(req_id, prompt)
    rec.begin_step()
    ids = routed(range(computed, len(prompt)), prompt)
    for layer in range(LAYERS):
        rec.capture(layer, ids[layer])
    rec.end_step([(req_id, computed, len(prompt) - computed)])


def direct(prompt: list[int]) -> np.ndarray:
    ids = routed(range(len(prompt)), prompt)
    return np.stack([np.bincount(ids[layer].ravel(), minlength=EXPERTS)
                     for layer in range(LAYERS)])


def test_external_id_strips_what_vllm_adds() -> None:
    assert external_id("cmpl-abc-0-1a2b3c4d") == "abc"
    assert external_id("chatcmpl-abc-def-1a2b3c4d") == "abc-def"
    assert external_id("plain") == "plain"


def test_block_hashes_are_chained_over_full_blocks() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]


def test_signature_is_exact_when_blocks_come_from_the_prefix_cache() -> None:
    rec = ExpertRecorder(LAYERS, EXPERTS, BLOCK)
    first = [5, 1, 7, 2, 9, 4, 4, 6, 3, 8]
    run_prefill(rec, "cmpl-a-0-00000000", first, computed=0)
    second = [*first[:8], 1, 1, 2]  # two cached blocks, never routed in this request
    run_prefill(rec, "cmpl-b-0-00000000", second, computed=8)
    a, b = rec.lookup("a"), rec.lookup("b")
    assert a is not None and b is not None
    assert np.array_equal(a["prefill"], direct(first)) and a["complete"]
    assert np.array_equal(b["prefill"], direct(second)) and b["complete"]
    assert b["cached_tokens"] == 8


def test_a_cached_block_the_recorder_never_saw_marks_the_signature_incomplete() -> None:
    rec = ExpertRecorder(LAYERS, EXPERTS, BLOCK)
    run_prefill(rec, "x", [1, 2, 3, 4, 5, 6], computed=4)
    found = rec.lookup("x")
    assert found is not None and not found["complete"]
    assert np.sum(found["prefill"]) == 2 * LAYERS * 2


def test_decode_steps_count_the_union_of_experts_per_layer() -> None:
    rec = ExpertRecorder(LAYERS, EXPERTS, BLOCK)
    for req_id in ("p", "q"):
        run_prefill(rec, req_id, [1, 2, 3], computed=0)
    rec.begin_step()
    for layer in range(LAYERS):  # p routes to {0, 1}, q to {1, 2}: union of 3 per layer
        rec.capture(layer, np.array([[0, 1], [1, 2]]))
    rec.end_step([("p", 3, 1), ("q", 3, 1)])
    assert (rec.decode_steps, rec.decode_tokens, rec.active_experts_sum) == (1, 2, 3.0)
    text = rec.metrics_text()
    assert "laneway_eldr_decode_active_experts_sum 3.0" in text
    assert 'laneway_eldr_decode_active_experts_by_batch_sum{batch="2"} 3.0' in text
    assert 'laneway_eldr_decode_steps_by_batch{batch="2"} 1' in text
    found = rec.lookup("p")
    assert found is not None and found["decode"][0][:3] == [1, 1, 0]


def test_a_resumed_request_is_counted_once() -> None:
    rec = ExpertRecorder(LAYERS, EXPERTS, BLOCK)
    prompt = [3, 1, 4, 1, 5, 9]
    run_prefill(rec, "r", prompt, computed=0)
    rec.restart("r")  # preempted, then recomputed from scratch
    rec.begin_step()
    ids = routed(range(len(prompt)), prompt)
    for layer in range(LAYERS):
        rec.capture(layer, ids[layer])
    rec.end_step([("r", 0, len(prompt))])
    found = rec.lookup("r")
    assert found is not None and np.array_equal(found["prefill"], direct(prompt))
