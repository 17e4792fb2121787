"""GPU profiles derived from spec sheets, anchored on published vLLM measurements.

`laneway emulate gpu-profiles` writes `profiles/<gpu>.yaml` from the numbers here, so
every figure in those files can be traced. The model is Llama-3.1-8B-Instruct (BF16;
on a T4, which has no BF16 and too little memory, its AWQ INT4 build in FP16).

How the step terms are derived (see `profile.py` for the step model):

* a = bytes of weights / (memory bandwidth x BW_EFFICIENCY): decode is memory-bound,
  every step streams all weights once.
* b = 2 x parameters FLOP per token / (dense tensor peak x MATMUL_EFFICIENCY).
* c = PER_SEQ_S, vLLM's per-request CPU work per step (sampling, scheduling, output).
* d = KV bytes per token / (bandwidth x BW_EFFICIENCY): decode attention reads the KV.
* e = attention FLOP per (query, key) pair / (tensor peak x ATTENTION_EFFICIENCY).
* KV capacity = (memory x gpu_memory_utilization - weights - ACTIVATION_RESERVE) / KV
  bytes per token, in blocks of 16; batch limits are vLLM's defaults for the GPU.

Anchors: BW_EFFICIENCY = 0.77 is what a published A100-40GB sweep measured for
single-stream decode of this model under vLLM (about 75 tokens/s, "roughly 77% of the
memory-bandwidth ceiling"); applied to the H100 it predicts 6.3 ms per token at
concurrency 1 where a published H100 sweep measured 6.48 ms. The other efficiencies
are typical values, not measurements, and are labelled so in each profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.emulator.profile import Profile, StepModel

GIB = 1024**3
BW_EFFICIENCY = 0.77
MATMUL_EFFICIENCY = 0.6
ATTENTION_EFFICIENCY = 0.4
PER_SEQ_S = 0.0001
ACTIVATION_RESERVE_BYTES = 2.5e9  # activations, CUDA graphs, sampler buffers
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
REQUEST_OVERHEAD_S = 0.002  # API server; H100 anchor: TTFT 14 ms = o + a + b·P
MAX_MODEL_LEN = 8192  # a common serving setting for 8B chat models

SOURCES_COMMON = [
    "A100-40GB anchor: J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100' "
    "(Llama-3.1-8B-Instruct BF16, vLLM 0.23, 1024 in / 128 out): ~75 tok/s at "
    "concurrency 1, ~77% of the bandwidth ceiling. "
    "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on",
    "H100 cross-check: InferenceBench 'Recipe: concurrency sweep' (Llama-3.1-8B-Instruct, "
    "vLLM 0.21, H100-80GB-HBM3): TPOT p50 6.48 ms at concurrency 1, 10.94 ms at 16; "
    "TTFT p50 14 ms at 1. https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/",
    "vLLM batch defaults: vllm/engine/arg_utils.py EngineArgs.get_batch_defaults "
    "(OpenAI server: 1024 seqs / 8192 tokens on >= 70 GiB non-A100 GPUs, else 256 / 2048)",
    "Llama-3.1-8B shapes: 8.03 B parameters, 32 layers, 8 KV heads x 128 dims "
    "(128 KiB of BF16 KV per token); meta-llama/Llama-3.1-8B-Instruct config.json",
]


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    title: str
    memory_bytes: float
    bandwidth: float  # bytes/s
    tensor_flops: float  # dense FP16/BF16 peak, FLOP/s
    weights_bytes: float
    spec_source: str
    quantization: str = "BF16"


PARAMS = 8.03e9
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
ATTENTION_FLOP_PER_PAIR = 2 * 2 * 32 * 128 * 32  # QK and AV, 32 heads x 128, 32 layers
BF16_WEIGHTS = 2 * PARAMS
# AWQ INT4: 4-bit linear layers (6.98 B params) + FP16 embeddings and head (2 x 0.53 B)
AWQ_WEIGHTS = 0.5 * 6.98e9 + 2 * 2 * 0.525e9 + 0.2e9  # + group scales/zeros

GPUS = (
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", 40 * GIB, 1.555e12, 312e12, BF16_WEIGHTS,
        "NVIDIA A100 datasheet: 1,555 GB/s HBM2, 312 TFLOPS BF16 dense"),
    Gpu("h100-80gb", "NVIDIA H100-SXM5-80GB", 80 * GIB, 3.35e12, 989e12, BF16_WEIGHTS,
        "NVIDIA H100 datasheet (SXM): 3.35 TB/s HBM3, 989 TFLOPS BF16 dense"),
    Gpu("l40s", "NVIDIA L40S (48 GB)", 45 * GIB, 0.864e12, 362e12, BF16_WEIGHTS,
        "NVIDIA L40S datasheet: 864 GB/s GDDR6, 362 TFLOPS BF16 dense; ~45 GiB usable"),
    Gpu("t4", "NVIDIA T4 (16 GB)", 15 * GIB, 0.320e12, 65e12, AWQ_WEIGHTS,
        "NVIDIA T4 datasheet: 320 GB/s GDDR6, 65 TFLOPS FP16; ~15 GiB usable",
        quantization="AWQ INT4 weights, FP16 activations"),
)


def batch_defaults(gpu: Gpu) -> tuple[int, int]:
    large = gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.name
    return (1024, 8192) if large else (256, 2048)


def derive(gpu: Gpu) -> Profile:
    bandwidth = gpu.bandwidth * BW_EFFICIENCY
    step = StepModel(
        base_s=gpu.weights_bytes / bandwidth,
        per_token_s=2 * PARAMS / (gpu.tensor_flops * MATMUL_EFFICIENCY),
        per_seq_s=PER_SEQ_S,
        per_context_s=KV_BYTES_PER_TOKEN / bandwidth,
        per_pair_s=ATTENTION_FLOP_PER_PAIR / (gpu.tensor_flops * ATTENTION_EFFICIENCY))
    kv_bytes = gpu.memory_bytes * GPU_MEMORY_UTILIZATION - gpu.weights_bytes \
        - ACTIVATION_RESERVE_BYTES
    max_num_seqs, max_num_batched_tokens = batch_defaults(gpu)
    return Profile(
        name=gpu.name, model="meta-llama/Llama-3.1-8B-Instruct",
        description=f"{gpu.title}, Llama-3.1-8B-Instruct ({gpu.quantization}), vLLM defaults",
        step=step, request_overhead_s=REQUEST_OVERHEAD_S,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_blocks=int(kv_bytes / KV_BYTES_PER_TOKEN) // 16, block_size=16,
        max_model_len=MAX_MODEL_LEN,
        sources=[gpu.spec_source, *SOURCES_COMMON],
        derivation=(
            "Derived, not measured on this GPU. "
            f"a = weights {gpu.weights_bytes / 1e9:.2f} GB / (bandwidth x {BW_EFFICIENCY}); "
            f"b = 2 x {PARAMS / 1e9:.2f} GFLOP / (tensor peak x {MATMUL_EFFICIENCY}); "
            f"c = {PER_SEQ_S * 1e3:.1f} ms per request (assumed); "
            f"d = {KV_BYTES_PER_TOKEN} B KV per token / (bandwidth x {BW_EFFICIENCY}); "
            f"e = {ATTENTION_FLOP_PER_PAIR} FLOP per attention pair / (tensor peak x "
            f"{ATTENTION_EFFICIENCY}); request overhead {REQUEST_OVERHEAD_S * 1e3:.0f} ms "
            f"(H100 anchor). KV = memory x {GPU_MEMORY_UTILIZATION} - weights - "
            f"{ACTIVATION_RESERVE_BYTES / 1e9:.1f} GB reserve. BW_EFFICIENCY is anchored "
            "on the A100 figure and checked on the H100 one (sources); the matmul and "
            "attention efficiencies and c are typical values, not measurements."))
