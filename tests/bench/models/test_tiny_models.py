"""The tiny-model builder: local tokenizer, loadable models, deterministic builds."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from bench.models.tiny_models import SPECIAL_TOKENS, VARIANTS, ensure_model


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("small", root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(small_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(small_dir)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_round_trips_text(tokenizer: Any) -> None:
    text = "Explain photosynthesis to a 5-year-old, please! Ünïcödé → 42 ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merged something: it was trained


def test_tokenizer_has_vocab_specials_and_chat_template(tokenizer: Any) -> None:
    assert len(tokenizer) == VARIANTS["small"].vocab
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token] == SPECIAL_TOKENS[:3]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>Hi\n<|assistant|>"


def test_model_dir_loads_with_transformers(small_dir: Path, tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(small_dir)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (2, 128, 64)
    assert config.max_position_embeddings >= 1024
    ids = torch.tensor([tokenizer.encode("Write a poem")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    # Special rows of the head are zero, so random weights never pick EOS (or any special).
    assert int(logits[0, -1].argmax()) >= len(SPECIAL_TOKENS)


def test_build_is_deterministic_and_cached(small_dir: Path, tmp_path: Path) -> None:
    again = ensure_model("small", root=tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(again / name) == sha256(small_dir / name), name
    built_at = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("small", root=tmp_path) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == built_at
    assert not list(tmp_path.glob("*.tmp-*"))  # the scratch build dir was renamed away
