from pathlib import Path

from predictors.length.data import (
    arrival_rows,
    chat_prompt,
    is_heldout,
    load_samples,
    samples_for,
    window_rows,
)
from tests.predictors.helpers import answer_length, counter, write_data


def test_heldout_split_is_ids_mod_five() -> None:
    assert [i for i in range(12) if is_heldout(i)] == [0, 5, 10]


def test_samples_count_lengths_themselves(tmp_path: Path) -> None:
    samples = load_samples(write_data(tmp_path / "d.jsonl", prompts=6), counter())
    assert len(samples) == 12 and {s.key for s in samples} == {"big-model", "small-model"}
    for s in samples:
        assert s.prompt.startswith("user: ")
        assert s.output_tokens == answer_length(s.prompt.removeprefix("user: "), s.key)
        assert s.prompt_tokens == len(s.prompt.split())
    assert len(samples_for(samples, "any")) == 12 and len(samples_for(samples, "big-model")) == 6


def test_windows_are_prefixes_at_multiples_of_tau(tmp_path: Path) -> None:
    samples = load_samples(write_data(tmp_path / "d.jsonl", prompts=6), counter())
    rows = window_rows(samples, counter(), tau=10, per_answer=3, seed=1)
    assert rows == window_rows(samples, counter(), tau=10, per_answer=3, seed=1)
    for row in rows:
        assert row.generated_tokens % 10 == 0 and 0 < row.generated_tokens < \
            row.sample.output_tokens
        assert row.sample.output.startswith(row.generated_text)
        assert len(row.generated_text.split()) == row.generated_tokens
        assert row.remaining == row.sample.output_tokens - row.generated_tokens
    assert all(r.generated_tokens == 0 and r.remaining == r.sample.output_tokens
               for r in arrival_rows(samples))
    assert chat_prompt("hi") == "user: hi"
