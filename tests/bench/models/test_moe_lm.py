"""The trained tiny MoE's material and training loop (its build is `make bench STUDY=eldr`'s)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.models.moe_corpus import PROSE_FROM, training_texts
from bench.models.tiny_models import VARIANTS
from bench.studies.eldr.prompts import domain_prompts
from predictors.home import DATASETS


def test_the_corpus_covers_the_study_domains_and_shares_no_prompt_with_it() -> None:
    study = domain_prompts(DATASETS, 40)
    corpus = training_texts(DATASETS, per_domain=100)
    assert {d for d, _ in corpus} == {d for d, _ in study}
    assert set(Counter(d for d, _ in corpus).values()) == {100}
    study_texts = {p for _, p in study}
    # no study prompt is in the corpus, nor inside a corpus text (prose carries answers)
    assert not any(p in text for _, text in corpus for p in study_texts)
    assert training_texts(DATASETS, per_domain=100) == corpus  # seeded
    assert PROSE_FROM > 40


def test_training_lowers_the_loss_and_balances_the_router() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bench.models.tiny_models import SPECIAL_TOKENS, build_tokenizer
    from bench.models.tiny_train import TrainSpec, train_lm

    texts = ["def f(x):\n    return x + 1", "один два три четыре пять", "2 + 2 = 4"] * 20
    tokenizer = build_tokenizer(iter(texts), 300 + len(SPECIAL_TOKENS))
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    result = train_lm(model, tokenizer, texts, TrainSpec(steps=100, batch=8, warmup=10))
    (_, first), (_, last) = result["loss_curve"][0], result["loss_curve"][-1]
    assert last < 0.5 * first
    assert model.config.router_aux_loss_coef == 0.01 and not model.training
    assert result["steps"] == 100 and result["documents"] == 60


def test_the_trained_variant_has_the_served_moe_shape() -> None:
    trained, random_weights = VARIANTS["moe-lm"], VARIANTS["moe"]
    assert trained.train_steps > 0 and random_weights.train_steps == 0
    assert (trained.arch, trained.layers, trained.hidden, trained.heads) == \
        (random_weights.arch, random_weights.layers, random_weights.hidden,
         random_weights.heads)
