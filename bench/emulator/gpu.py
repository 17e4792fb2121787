"""GPU profiles derived from spec sheets, anchored on published vLLM measurements.

`python -m bench emulate gpu-profiles` writes `profiles/<gpu>.yaml` from the numbers here, so
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


@dataclass(frozen=True, slots=True)
class Model:
    """A served model's shapes: all the step model needs of it."""

    slug: str
    hf_id: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def kv_bytes_per_token(self) -> int:  # K and V, BF16
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def attention_flop_per_pair(self) -> int:  # QK and AV over every head and layer
        return 2 * 2 * self.heads * self.head_dim * self.layers

    @property
    def bf16_weights(self) -> float:
        return 2 * self.params


LLAMA_8B = Model("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 8.03e9, 32, 32, 8, 128,
                 "Llama-3.1-8B shapes: 8.03 B parameters, 32 layers, 8 KV heads x 128 dims "
                 "(128 KiB of BF16 KV per token); meta-llama/Llama-3.1-8B-Instruct config.json")
BF16_WEIGHTS = LLAMA_8B.bf16_weights
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


# The qos_drl paper's edge: every expert on its own RTX 4090 (profiles written with the
# others; `bench.studies.qos.setup.PAPER_FLEET`).
RTX_4090 = Gpu("rtx4090", "NVIDIA GeForce RTX 4090 (24 GB)", 24 * GIB, 1.008e12, 165.2e12,
               BF16_WEIGHTS, "NVIDIA Ada (AD102) whitepaper, GeForce RTX 4090: 1,008 GB/s "
               "GDDR6X, 165.2 TFLOPS BF16 dense with FP32 accumulate, 24 GB")

# The alpaca_eval experts' own shapes (config.json of each; the FuseChat models are
# fine-tunes with their base models' shapes); gpt-3.5-turbo's are not published, and
# Llama-3.1-8B stands in for it.
EXPERT_MODELS = (
    Model("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", 1.24e9, 16, 32, 8, 64,
          "Llama-3.2-1B shapes: 1.24 B parameters (tied embeddings), 16 layers, 32 heads, "
          "8 KV heads x 64 dims; meta-llama/Llama-3.2-1B-Instruct config.json"),
    Model("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", 3.21e9, 28, 24, 8, 128,
          "Llama-3.2-3B shapes: 3.21 B parameters, 28 layers, 24 heads, 8 KV heads x 128 "
          "dims; meta-llama/Llama-3.2-3B-Instruct config.json"),
    Model("qwen-2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 7.62e9, 28, 28, 4, 128,
          "Qwen2.5-7B shapes: 7.62 B parameters, 28 layers, 28 heads, 4 KV heads x 128 dims; "
          "Qwen/Qwen2.5-7B-Instruct config.json"),
    Model("gemma-2b", "google/gemma-2b-it", 2.51e9, 18, 8, 1, 256,
          "gemma-2b shapes: 2.51 B parameters, 18 layers, 8 heads, 1 KV head x 256 dims "
          "(multi-query); google/gemma-2b-it config.json"),
    Model("gemma-7b", "google/gemma-7b-it", 8.54e9, 28, 16, 16, 256,
          "gemma-7b shapes: 8.54 B parameters, 28 layers, 16 heads, 16 KV heads x 256 dims "
          "(448 KiB of BF16 KV per token); google/gemma-7b-it config.json"),
    LLAMA_8B,
)


def expert_profiles() -> list[Profile]:
    """Every expert model on its own RTX 4090 (Llama-3.1-8B there is `rtx4090`)."""
    return [derive(RTX_4090, None if m is LLAMA_8B else m) for m in EXPERT_MODELS]


def batch_defaults(gpu: Gpu) -> tuple[int, int]:
    large = gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.name
    return (1024, 8192) if large else (256, 2048)


def derive(gpu: Gpu, model: Model | None = None) -> Profile:
    """The profile of `model` (default Llama-3.1-8B, in the GPU's own weight format) on
    `gpu`; another model runs in BF16 and is named `<gpu>-<model slug>`."""
    if model is not None and gpu.quantization != "BF16":
        raise ValueError(f"{gpu.name} serves only its own Llama-3.1-8B build "
                         f"({gpu.quantization}): derive it without a model")
    served = model or LLAMA_8B
    weights = gpu.weights_bytes if model is None else served.bf16_weights
    bandwidth = gpu.bandwidth * BW_EFFICIENCY
    step = StepModel(
        base_s=weights / bandwidth,
        per_token_s=2 * served.params / (gpu.tensor_flops * MATMUL_EFFICIENCY),
        per_seq_s=PER_SEQ_S,
        per_context_s=served.kv_bytes_per_token / bandwidth,
        per_pair_s=served.attention_flop_per_pair / (gpu.tensor_flops * ATTENTION_EFFICIENCY))
    kv_bytes = gpu.memory_bytes * GPU_MEMORY_UTILIZATION - weights - ACTIVATION_RESERVE_BYTES
    kv_blocks = int(kv_bytes / served.kv_bytes_per_token) // 16
    if kv_blocks * 16 < 1024:
        raise ValueError(f"{served.slug} leaves no room for a KV cache on {gpu.name}")
    # vLLM refuses a max_model_len its KV cache cannot hold: shorten it as a deployment would
    max_model_len = min(MAX_MODEL_LEN, kv_blocks * 16 // 1024 * 1024)
    max_num_seqs, max_num_batched_tokens = batch_defaults(gpu)
    title = served.hf_id.split("/")[-1]
    return Profile(
        name=gpu.name if model is None else f"{gpu.name}-{served.slug}", model=served.hf_id,
        description=f"{gpu.title}, {title} ({gpu.quantization}), vLLM defaults"
        + ("" if max_model_len == MAX_MODEL_LEN else f", max_model_len {max_model_len}"),
        step=step, request_overhead_s=REQUEST_OVERHEAD_S,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_blocks=kv_blocks, block_size=16, max_model_len=max_model_len,
        sources=[gpu.spec_source, *SOURCES_COMMON, served.source],
        derivation=(
            "Derived, not measured on this GPU. "
            f"a = weights {weights / 1e9:.2f} GB / (bandwidth x {BW_EFFICIENCY}); "
            f"b = 2 x {served.params / 1e9:.2f} GFLOP / (tensor peak x {MATMUL_EFFICIENCY}); "
            f"c = {PER_SEQ_S * 1e3:.1f} ms per request (assumed); "
            f"d = {served.kv_bytes_per_token} B KV per token / (bandwidth x {BW_EFFICIENCY}); "
            f"e = {served.attention_flop_per_pair} FLOP per attention pair / (tensor peak x "
            f"{ATTENTION_EFFICIENCY}); request overhead {REQUEST_OVERHEAD_S * 1e3:.0f} ms "
            f"(H100 anchor). KV = memory x {GPU_MEMORY_UTILIZATION} - weights - "
            f"{ACTIVATION_RESERVE_BYTES / 1e9:.1f} GB reserve. BW_EFFICIENCY is anchored "
            "on the A100 figure and checked on the H100 one (sources); the matmul and "
            "attention efficiencies and c are typical values, not measurements."))
