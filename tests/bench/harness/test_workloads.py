"""Workloads: alpaca prompts at seeded arrivals, Mooncake replay with shared prefixes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from bench.harness import workloads
from bench.harness.workloads import LengthFit, WorkloadSpec
from bench.models.lexicon import alpaca_rows, bpe_lexicon, load_lexicon, truncate
from bench.models.tiny_models import build_tokenizer, instructions
from predictors.home import DATASETS, open_text

TRACE = DATASETS / "traces" / "mooncake_conversation.jsonl"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny models' tokenizer, built from the data as `bench.models.tiny_models` does."""
    target = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(instructions(DATASETS), 4096).save_pretrained(target)
    yield str(target / "tokenizer.json")


def spec(kind: str, tokenizer: str, **kw: object) -> WorkloadSpec:
    return WorkloadSpec(kind, DATASETS, tokenizer=tokenizer, **kw)  # type: ignore[arg-type]


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def trace_rows(n: int) -> list[dict[str, Any]]:
    with open_text(TRACE) as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def test_alpaca_workload_is_seeded(tokenizer_json: str) -> None:
    first = workloads.build(spec("poisson", tokenizer_json, n=30, rate=4.0, seed=5))
    again = workloads.build(spec("poisson", tokenizer_json, n=30, rate=4.0, seed=5))
    other = workloads.build(spec("poisson", tokenizer_json, n=30, rate=4.0, seed=6))
    assert first == again
    assert [r.id for r in first.requests] != [r.id for r in other.requests]
    assert [r.arrival_s for r in first.requests] != [r.arrival_s for r in other.requests]


def test_heldout_prompts_are_the_predictors_unseen_split(tokenizer_json: str) -> None:
    built = workloads.build(spec("poisson", tokenizer_json, n=200, rate=4.0,
                                 prompts="heldout"))
    ids = {int(r.id.removeprefix("alpaca-")) for r in built.requests}
    assert ids and all(i % 5 == 0 for i in ids) and built.meta["prompts"] == "heldout"
    every = workloads.build(spec("poisson", tokenizer_json, n=200, rate=4.0))
    assert any(int(r.id.removeprefix("alpaca-")) % 5 for r in every.requests)
    with pytest.raises(ValueError, match="prompt set"):
        workloads.build(spec("poisson", tokenizer_json, n=5, prompts="train"))


def test_alpaca_requests_ask_for_the_experts_real_answer_length(tokenizer_json: str) -> None:
    built = workloads.build(spec("gamma", tokenizer_json, n=40, rate=2.0, cv=3.0,
                                 expert="gemma-7b-it"))
    lexicon = bpe_lexicon(Path(tokenizer_json))
    rows = {f"alpaca-{r['id']}": r for r in alpaca_rows(DATASETS)}
    fit = LengthFit()
    for request in built.requests:
        row = rows[request.id]
        answer = lexicon.count(row["experts"]["gemma-7b-it"]["output"])
        prompt = lexicon.count(row["instruction"])
        assert (request.prompt_tokens, request.max_tokens) == fit.clip(prompt, answer)
        assert request.prompt_tokens + request.max_tokens + fit.margin <= fit.context
        assert request.quality["gemma-7b-it"] == row["experts"]["gemma-7b-it"][
            "win_rate_vs_reference"]
        assert len(request.quality) == 6
    assert built.meta["exact_lengths"] is True


def test_length_fit_caps_output_then_prompt() -> None:
    fit = LengthFit(context=100, max_output=30, margin=10)
    assert fit.clip(20, 50) == (20, 30)  # max_output
    assert fit.clip(80, 20) == (70, 20)  # prompt cut to leave the output room
    assert fit.clip(90, 90) == (60, 30)
    half = LengthFit(context=100, margin=10)
    assert half.clip(90, 90) == (45, 45)  # output cut to leave the prompt half the room
    assert half.clip(10, 90) == (10, 80)


def test_truncated_prompts_fit_the_context(tokenizer_json: str) -> None:
    built = workloads.build(spec("poisson", tokenizer_json, n=805, rate=50.0,
                                 fit=LengthFit(context=256)))
    lexicon = bpe_lexicon(Path(tokenizer_json))
    instructions_by_id = {f"alpaca-{r['id']}": r["instruction"]
                          for r in alpaca_rows(DATASETS)}
    truncated = [r for r in built.requests if r.prompt != instructions_by_id[r.id]]
    assert len(truncated) >= 5  # long instructions were cut ...
    for request in truncated:  # ... to a word prefix of the instruction
        assert instructions_by_id[request.id].startswith(request.prompt)
    assert all(r.prompt_tokens == lexicon.count(r.prompt) for r in built.requests)
    assert max(r.prompt_tokens + r.max_tokens for r in built.requests) <= 256 - 8
    assert truncate(lexicon, "one two three four", 2) == "one two"


def test_trace_keeps_arrivals_scaled_by_time_scale(tokenizer_json: str) -> None:
    built = workloads.build(spec("trace", tokenizer_json, n=300, time_scale=0.5))
    rows = trace_rows(300)
    expected = [(r["timestamp"] - rows[0]["timestamp"]) / 1000 * 0.5 for r in rows]
    assert [r.arrival_s for r in built.requests] == pytest.approx(expected)
    assert [r.id for r in built.requests] == [f"mooncake_conversation-{i}" for i in range(300)]


def test_trace_lengths_are_divided_by_one_factor(tokenizer_json: str) -> None:
    built = workloads.build(spec("trace", tokenizer_json, n=200,
                                 fit=LengthFit(context=1024, scale=64.0)))
    block = built.meta["block_tokens"]
    assert block == 8
    for request, row in zip(built.requests, trace_rows(200), strict=True):
        prompt = min(round(row["input_length"] / 64), block * len(row["hash_ids"]))
        output = max(1, round(row["output_length"] / 64))
        assert (request.prompt_tokens, request.max_tokens) == LengthFit(1024).clip(prompt, output)


def test_trace_auto_scale_fits_most_requests_unclipped(tokenizer_json: str) -> None:
    built = workloads.build(spec("trace", tokenizer_json, n=500))
    scale = built.meta["fit"]["scale"]
    rows = trace_rows(500)
    unclipped = sum(1 for r, row in zip(built.requests, rows, strict=True)
                    if r.prompt_tokens == max(1, round(row["input_length"] / scale)))
    assert unclipped >= 0.85 * len(rows)
    assert built.meta["block_tokens"] == 512 / scale


def test_trace_prefixes_are_shared_exactly_as_hash_ids_are(tokenizer_json: str) -> None:
    built = workloads.build(spec("trace", tokenizer_json, n=150,
                                 fit=LengthFit(context=4096, scale=32.0)))
    block = built.meta["block_tokens"]
    lexicon = bpe_lexicon(Path(tokenizer_json))
    rows = trace_rows(150)
    shared_pairs = 0
    for i, j in pairwise(range(150)):
        for a, b in ((i, j), (0, j)):
            same_blocks = common_prefix(rows[a]["hash_ids"], rows[b]["hash_ids"])
            words_a = built.requests[a].prompt.split()
            words_b = built.requests[b].prompt.split()
            common, shortest = common_prefix(words_a, words_b), min(len(words_a), len(words_b))
            assert common >= min(same_blocks * block, shortest)
            if same_blocks * block < shortest:
                assert common < (same_blocks + 1) * block  # the next block differs
            shared_pairs += same_blocks > 0 and a != b
    assert shared_pairs > 20  # the trace really shares prefixes
    for request in built.requests[:20]:  # exact lengths with the real tokenizer
        assert lexicon.count(request.prompt) == request.prompt_tokens


def test_words_fallback_is_marked_approximate(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    built = workloads.build(spec("onoff", "words", n=10, rate=5.0))
    assert built.meta["lexicon"] == "words" and built.meta["exact_lengths"] is False
    assert all(r.prompt_tokens == len(r.prompt.split()) for r in built.requests)
    monkeypatch.setenv("LANEWAY_HOME", str(tmp_path))  # no tiny model built there
    texts = [r["instruction"] for r in alpaca_rows(DATASETS)]
    assert load_lexicon("auto", texts).name == "words"


def test_saved_workload_loads_back_equal(tmp_path: Path, tokenizer_json: str) -> None:
    built = workloads.build(spec("poisson", tokenizer_json, n=12, rate=3.0))
    slo = dataclasses.replace(built.requests[0], slo_s=1.5)
    built = dataclasses.replace(built, requests=(slo, *built.requests[1:]))
    workloads.save(built, tmp_path / "w.jsonl")
    assert workloads.load(tmp_path / "w.jsonl") == built


def test_unknown_kind_or_expert_is_an_error(tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match="unknown workload kind"):
        workloads.build(spec("uniform", tokenizer_json))
    with pytest.raises(ValueError, match="unknown expert"):
        workloads.build(spec("poisson", tokenizer_json, n=2, expert="gpt-9"))
