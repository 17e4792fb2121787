"""qos_drl (`qos_drl_edge_routing.txt`): QoS-aware routing over several expert models with
a HAN state encoder and a discrete SAC actor; the action set is the N experts + drop.

At start the policy loads the trained agent (`python -m bench train qos-drl`) and the bucket
predictor (`laneway train buckets`). Per request it takes the predicted score and length
buckets on every expert (in the proxy from its bucket stage, `proxy/routing/stages.py`: the
encoder runs in a worker thread, batched across concurrent arrivals), builds the
state graph from live `BackendStats` (KV use, running, waiting) and the requests it
routed itself and has not yet seen finish (their generated tokens estimated from
elapsed time and the backend's TPOT), masks experts with no candidate backend, and
acts greedily. Drop → `Decision.drop` → 503
`request_dropped` with the reason.

Online learning (`learn_online`, off by default): each outcome's QoS is estimated as
the predicted score * 1[e2e / tokens ≤ L] (the true score is not observable live),
rewards follow Eq. 16 with the checkpoint's k1, k2, and one SAC update runs per
decision once `online_warmup` transitions are stored, in a thread of its own
(`online_thread`; `policies/qos_drl/online.py`), so a decision does not wait the ~20-25 ms
it takes. Every `online_report_every` updates the policy logs them with the mean
reward since the last report and, with `online_save`, writes the agent to that
checkpoint, so what it learned survives a restart.

`mode: bert_router` is the paper's BERT-router baseline on the same machinery: the
expert with the highest predicted score among those with a backend (ties at random,
seeded, as in the simulator's), never a drop. A Baseline RL checkpoint
(`python -m bench train qos-drl --baseline`) loads as is: its MLP reads the expert-level
features of the same state.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from policies.base import PARAMS_CONFIG, register
from policies.qos_drl.impact import Coefficients, qos
from policies.qos_drl.state import ExpertState, build_state
from predictors.base import BucketEstimate, BucketRuntime, checkpoint_estimate
from proxy.types import (
    Backend,
    BatchedBuckets,
    ClusterView,
    Decision,
    Outcome,
    Prediction,
    RequestContext,
    StageSpec,
)

if TYPE_CHECKING:  # torch loads only when the policy is built
    from policies.qos_drl.online import OnlineLearner

log = logging.getLogger(__name__)


class QosDrlParams(BaseModel):
    model_config = PARAMS_CONFIG
    checkpoint: str = Field(description="agent checkpoint of `python -m bench train qos-drl`")
    buckets: str | None = Field(None, description="bucket predictor artifact (None: "
                                "no predictions, the paper's ablation)")
    buckets_runtime: BucketRuntime = Field(
        "onnx-int8", description="how the predictor runs: torch (float), torch-int8, onnx "
        "(float), onnx-int8 (ONNX Runtime, fused graph, int8 weights: the fastest, within "
        "0.3 points of float held out; `laneway evaluate buckets --runtime`)")
    buckets_max_len: int | None = Field(None, gt=0, description="cut prompts to this many "
                                        "tokens, [CLS], [SEP] and the expert tokens "
                                        "included (None: as the artifact was trained)")
    buckets_threads: int = Field(1, gt=0, description="ONNX Runtime intra-op threads of "
                                 "the predictor (the proxy's event loop shares the cores)")
    buckets_estimate: BucketEstimate | None = Field(
        None, description="the value read from each predicted bucket distribution: "
        "midpoint (of the most likely bucket, the paper) or expected (the probability-"
        "weighted mean of the midpoints); None: the one the checkpoint was trained on "
        "(`python -m bench train qos-drl --bucket-estimate`), midpoint for older checkpoints")
    buckets_int8: bool | None = Field(None, description="deprecated, read as buckets_runtime "
                                      "torch-int8 (true) or torch (false)")
    experts: dict[str, str] = Field(default_factory=dict, description="backend model or "
                                    "name -> expert name of the checkpoint (default: same)")
    limit_ms: float = Field(30.0, gt=0, description="L: latency per token requirement")
    allow_drop: bool = Field(True, description="may answer 503 request_dropped")
    chars_per_token: float = Field(4.0, gt=0, description="p_j estimate from prompt chars")
    default_tpot_s: float = Field(0.03, gt=0, description="TPOT before any scrape")
    learn_online: bool = Field(False, description="keep training on observed outcomes")
    online_warmup: int = Field(256, gt=0, description="transitions before updates")
    online_batch: int = Field(32, gt=0)
    online_thread: bool = Field(True, description="train in a thread of its own, decisions "
                                "acting on a copy refreshed after each update (false: "
                                "inline, ~20-25 ms of every decision on the event loop)")
    online_report_every: int = Field(100, gt=0, description="every this many online "
                                     "updates: log them (INFO) and write `online_save`")
    online_save: str | None = Field(None, description="write the agent learned online to "
                                    "this checkpoint (atomically, every "
                                    "`online_report_every` updates); `checkpoint` can "
                                    "start from it after a restart")
    predict_max_batch: int = Field(16, gt=0, description="prompts per encoder batch "
                                   "(arrivals during a batch go together in the next)")
    predict_timeout_s: float = Field(2.0, gt=0, description="longer: decide without "
                                     "predictions")
    mode: Literal["agent", "bert_router"] = Field(
        "agent", description="agent: the checkpoint's actor; bert_router: the paper's "
        "BERT-router baseline, argmax of the predicted score (needs `buckets`; no drops)")

    @model_validator(mode="after")
    def _save_needs_learning(self) -> QosDrlParams:
        if self.online_save is not None and not self.learn_online:
            raise ValueError("online_save needs learn_online: true")
        return self

    @model_validator(mode="before")
    @classmethod
    def _runtime_from_int8(cls, data: Any) -> Any:
        """Configs written for `buckets_int8` keep the runtime they meant."""
        if not isinstance(data, dict) or not isinstance(data.get("buckets_int8"), bool):
            return data
        meant = "torch-int8" if data["buckets_int8"] else "torch"
        if data.get("buckets_runtime", meant) != meant:
            raise ValueError(f"buckets_int8: {data['buckets_int8']} contradicts "
                             f"buckets_runtime: {data['buckets_runtime']}; drop buckets_int8")
        return {**data, "buckets_runtime": meant}


@register
class QosDrl:
    name: ClassVar[str] = "qos_drl"
    Params: ClassVar[type[BaseModel]] = QosDrlParams

    def __init__(self, params: QosDrlParams) -> None:
        # torch loads only when this policy is configured, not when policies/ is imported
        import torch

        from policies.qos_drl.online import InflightBook, OnlineLearner
        from policies.qos_drl.sac import GreedyActor, load_checkpoint

        torch.set_num_threads(1)  # small graphs, one at a time: 2 threads are 15x slower
        self._p = params
        self.agent, self.meta = load_checkpoint(Path(params.checkpoint))
        self.experts: list[str] = list(self.meta["experts"])
        self.predictor: Any = None
        if params.buckets is not None:
            from predictors.buckets.predictor import load_artifact

            self.predictor = load_artifact(Path(params.buckets), params.buckets_runtime,
                                           params.buckets_max_len, params.buckets_threads,
                                           checkpoint_estimate(self.meta,
                                                               params.buckets_estimate))
            if list(self.predictor.experts) != self.experts:
                raise ValueError("bucket predictor and checkpoint name different experts")
        elif params.mode == "bert_router":
            raise ValueError("mode bert_router needs a bucket predictor (`buckets`)")
        self._ties = random.Random(0)
        self._known = set(self.experts)
        self._unknown: set[str] = set()  # backends already warned of
        self.k = [Coefficients(*self.meta["k"][e]) for e in self.experts]
        self.book = InflightBook(params.limit_ms / 1000, params.default_tpot_s)
        self.learner = OnlineLearner(
            self.agent, params.online_warmup, params.online_batch,
            background=params.online_thread, report_every=params.online_report_every,
            on_report=self._report_online) if params.learn_online else None
        self.greedy = GreedyActor(self.agent) if self.learner is None else None

    @property
    def params(self) -> QosDrlParams:
        return self._p

    def stages(self) -> tuple[StageSpec, ...]:
        """With a bucket predictor, its predictions batched off the event loop."""
        if self.predictor is None:
            return ()
        return (BatchedBuckets(self.predictor, self.params.predict_max_batch,
                               self.params.predict_timeout_s),)

    def predict(self, prompt: str, pred: Prediction) -> tuple[list[float], list[float]]:
        """Per expert (score, length): from the proxy's bucket stage when it ran (off
        the event loop, batched), else computed here; zeros without a predictor."""
        none = [0.0] * len(self.experts)
        if pred.expert_scores is not None and pred.expert_lengths is not None:
            if not pred.expert_scores:  # the stage's predictor failed or timed out
                return none, list(none)
            return list(pred.expert_scores), list(pred.expert_lengths)
        if self.predictor is None:
            return none, list(none)
        got = self.predictor.predict_batch([prompt])[0]
        return list(got.score), list(got.length)

    def pick(self, ctx: RequestContext, pred: Prediction, view: ClusterView) -> Decision:
        import torch

        from policies.qos_drl.sac import batch_states

        scores, lengths = self.predict(ctx.prompt_text, pred)
        prompt_tokens = max(1, int(len(ctx.prompt_text) / self._p.chars_per_token))
        backends = self._backends(view)
        if self._p.mode == "bert_router":
            return self._best_predicted(scores, backends, view)
        states = [self._expert_state(b, view) for b in backends]
        graph = build_state(prompt_tokens, scores, lengths, states, self._p.limit_ms / 1000)
        mask = torch.tensor([[self._p.allow_drop, *(b is not None for b in backends)]])
        g = batch_states([graph])
        if self.learner is None:
            assert self.greedy is not None
            action = self.greedy(g, mask)
        else:
            action = self.learner.acting(g, mask)
            chosen = backends[action - 1] if action else None
            self.learner.decided(graph, action, self.book.impact(
                chosen, prompt_tokens, lengths[action - 1] if action else 0,
                self.k[action - 1] if action else None, view))
        if action == 0:
            return Decision(view.candidates[0], "qos_drl: drop",
                            drop=f"no expert meets the {self._p.limit_ms:g} ms/token "
                                 "requirement without hurting the requests it runs")
        backend = backends[action - 1]
        assert backend is not None
        self.book.routed(ctx.request_id, backend, prompt_tokens, scores[action - 1],
                         lengths[action - 1], view.now)
        return Decision(backend, f"qos_drl: expert {self.experts[action - 1]} "
                                 f"(predicted score {scores[action - 1]:.2f})")

    def _report_online(self, learner: OnlineLearner) -> None:
        """Every `online_report_every` updates, in the learning thread (between updates,
        so the agent saved is whole): a log line and `online_save`."""
        from policies.qos_drl.sac import save_checkpoint

        rewards = learner.take_rewards()
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        saved, level = "", logging.INFO
        if self._p.online_save is not None:
            path = Path(self._p.online_save)
            partial = path.with_name(path.name + ".partial")
            try:
                save_checkpoint(partial, self.agent, {
                    **self.meta,  # a restart from it counts on and names the first one
                    "online_updates": self.meta.get("online_updates", 0) + learner.updates,
                    "online_from": self.meta.get("online_from", self._p.checkpoint)})
                os.replace(partial, path)  # a reader never sees half a checkpoint
                saved = f"; saved to {path}"
            except OSError as exc:  # routing goes on; the next report tries again
                saved, level = f"; not saved to {path}: {exc}", logging.WARNING
        log.log(level, "qos_drl online: %d updates (%d skipped), mean reward %.4f over the "
                "last %d transitions%s", learner.updates, learner.skipped, mean, len(rewards),
                saved)

    def _best_predicted(self, scores: list[float], backends: list[Backend | None],
                        view: ClusterView) -> Decision:
        served = [n for n, b in enumerate(backends) if b is not None]
        if not served:
            return Decision(view.candidates[0], "bert_router: no candidate serves an expert")
        best = max(scores[n] for n in served)
        n = self._ties.choice([n for n in served if scores[n] == best])
        backend = backends[n]
        assert backend is not None
        return Decision(backend, f"bert_router: expert {self.experts[n]} "
                                 f"(predicted score {best:.2f})")

    def _backends(self, view: ClusterView) -> list[Backend | None]:
        """Per expert (checkpoint order), the least-loaded candidate serving it."""
        by_expert: dict[str, Backend] = {}
        for b in view.candidates:
            expert = self._p.experts.get(b.model) or self._p.experts.get(b.name) or b.model
            if expert not in self._known and b.name not in self._unknown:
                self._unknown.add(b.name)  # said once per backend
                log.warning("qos_drl: backend %s serves %s, which is not an expert of the "
                            "checkpoint (%s); it is never picked (map it with the `experts` "
                            "param)", b.name, expert, ", ".join(self.experts))
            best = by_expert.get(expert)
            if best is None or view.inflight_of(b) < view.inflight_of(best):
                by_expert[expert] = b
        return [by_expert.get(e) for e in self.experts]

    def _expert_state(self, backend: Backend | None, view: ClusterView) -> ExpertState:
        if backend is None:
            return ExpertState(1.0, 0, 0, (), ())
        stats = view.stats_of(backend)
        running, waiting = self.book.requests(backend.name, stats, view.now)
        return ExpertState(stats.kv_usage, max(stats.running, len(running)), stats.waiting,
                           tuple(running), tuple(waiting))

    def observe(self, outcome: Outcome) -> None:
        routed = self.book.finished(outcome.request_id)
        if routed is None or self.learner is None or not outcome.ok:
            return
        tokens = max(1, outcome.completion_tokens)
        self.learner.completed(qos(routed.score, outcome.e2e_s / tokens,
                                   self._p.limit_ms / 1000))
