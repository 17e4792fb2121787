"""Replay buffer of state graphs for SAC (the trainer, bench/studies/qos/train.py, and qos_drl's
online learning)."""

from __future__ import annotations

import numpy as np
import torch

from policies.qos_drl.state import GraphState

_FIELDS = ("arrived", "experts", "running", "running_mask", "waiting", "waiting_mask")


class Replay:
    """Fixed-capacity ring buffer of (s, a, r, s', done), states as dense arrays."""

    def __init__(self, capacity: int, example: GraphState, seed: int = 0) -> None:
        self.capacity, self.size, self.cursor = capacity, 0, 0
        self.rng = np.random.default_rng(seed)
        self.s = {f: np.zeros((capacity, *getattr(example, f).shape), np.float32)
                  for f in _FIELDS}
        self.s2 = {f: np.zeros_like(v) for f, v in self.s.items()}
        self.a = np.zeros(capacity, np.int64)
        self.r = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, np.float32)

    def add(self, s: GraphState, a: int, r: float, s2: GraphState, done: bool) -> None:
        i = self.cursor
        for f in _FIELDS:
            self.s[f][i] = getattr(s, f)
            self.s2[f][i] = getattr(s2, f)
        self.a[i], self.r[i], self.done[i] = a, r, float(done)
        self.cursor = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor,
                                          dict[str, torch.Tensor], torch.Tensor]:
        idx = self.rng.integers(0, self.size, batch)
        return (_tensors(self.s, idx), torch.from_numpy(self.a[idx]),
                torch.from_numpy(self.r[idx]), _tensors(self.s2, idx),
                torch.from_numpy(self.done[idx]))


def _tensors(store: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, torch.Tensor]:
    out = {f: torch.from_numpy(v[idx]) for f, v in store.items()}
    n = out["experts"].shape[1]
    out["flat"] = out["experts"][:, :, :3].reshape(len(idx), 3 * n)
    return out
