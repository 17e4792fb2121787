"""Direct router traces of the tiny Qwen3-MoE, with transformers (no vLLM).

The reference the ELDR plugin is checked against, and the offline source of the
prefill/decode activations the signature study (`predictors/eldr/experts.py`) measures:
a forward hook on every MoE gate records each token's top-k expert ids and gate
probabilities. Greedy generation gives the decode-time activations of one request.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RouterTrace:
    """One request's routing: `prefill_ids` [layers, prompt tokens, k], `prefill_probs`
    [layers, prompt tokens, experts], `decode_ids` [layers, generated tokens, k]."""

    prefill_ids: np.ndarray
    prefill_probs: np.ndarray
    decode_ids: np.ndarray

    def counts(self, experts: int, decode: bool = False) -> np.ndarray:
        """[layers, experts] top-k token counts of the prefill (or of the decode)."""
        ids = self.decode_ids if decode else self.prefill_ids
        out = np.zeros((ids.shape[0], experts), np.int64)
        for layer in range(ids.shape[0]):
            out[layer] = np.bincount(ids[layer].ravel(), minlength=experts)
        return out


class MoeTracer:
    """The tiny MoE loaded with transformers (bf16 like the vLLM servers; fp32 is faster
    on a CPU without bf16 units, for studies that need no bit-level match)."""

    def __init__(self, model_dir: Path, dtype: str = "bfloat16") -> None:
        torch: Any = importlib.import_module("torch")
        transformers: Any = importlib.import_module("transformers")
        self._torch = torch
        torch.set_num_threads(1)  # tiny matmuls: more threads only contend on 2 cores
        self.model = transformers.Qwen3MoeForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.experts = int(self.model.config.num_experts)
        self._calls: list[list[tuple[Any, Any]]] = []
        for layer in self.model.model.layers:
            layer.mlp.gate.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        logits, _, indices = output
        if not self._calls or len(self._calls[-1]) == len(self.model.model.layers):
            self._calls.append([])
        probs = self._torch.softmax(logits.float(), dim=-1)
        self._calls[-1].append((indices.numpy().copy(), probs.numpy().copy()))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def trace(self, prompt_token_ids: list[int], decode_tokens: int = 0) -> RouterTrace:
        """Route the prompt (one forward) and, if asked, `decode_tokens` greedy steps."""
        self._calls = []
        with self._torch.no_grad():
            input_ids = self._torch.tensor([prompt_token_ids])
            if decode_tokens:
                self.model.generate(input_ids, max_new_tokens=decode_tokens,
                                    min_new_tokens=decode_tokens, do_sample=False)
            else:
                self.model(input_ids)
        prefill = self._calls[0]
        decode = self._calls[1:1 + max(decode_tokens - 1, 0)]
        layers = len(prefill)
        k = prefill[0][0].shape[1]
        decode_ids = (np.stack([np.concatenate([step[layer][0] for step in decode])
                                for layer in range(layers)]) if decode
                      else np.zeros((layers, 0, k), np.int64))
        return RouterTrace(np.stack([ids for ids, _ in prefill]),
                           np.stack([probs for _, probs in prefill]), decode_ids)
