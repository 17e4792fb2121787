"""The datasheet-derived GPU profiles: the YAML files are what `bench/emulator/gpu.py`
derives, and a model's shapes change the step model the way its size should."""

from __future__ import annotations

import pytest

from bench.emulator.gpu import (
    GPUS,
    LLAMA_8B,
    MAX_MODEL_LEN,
    RTX_4090,
    derive,
    expert_profiles,
)
from bench.emulator.profile import load_profile
from bench.studies.qos.setup import FLEETS, PAPER_FLEET


def decode_ms(name: str, seqs: int = 1, context: int = 512) -> float:
    step = load_profile(name).step
    return step.seconds(seqs, seqs, seqs * step.read_context(context), seqs * context) * 1e3


@pytest.mark.parametrize("profile", [derive(g) for g in GPUS] + expert_profiles(),
                         ids=lambda p: p.name)
def test_checked_in_profiles_are_the_derived_ones(profile):
    # `python -m bench emulate gpu-profiles` wrote them; an edit to gpu.py must rewrite them
    assert load_profile(profile.name) == profile


def test_a_model_is_named_after_it_and_default_keeps_the_gpu_name():
    assert derive(RTX_4090).name == "rtx4090"
    assert derive(RTX_4090).model == LLAMA_8B.hf_id
    names = {p.name for p in expert_profiles()}
    assert names == set(PAPER_FLEET.values())


def test_smaller_models_step_faster_on_the_same_gpu():
    by_expert = {e: decode_ms(p) for e, p in PAPER_FLEET.items()}
    assert by_expert["FuseChat-Llama-3.2-1B-Instruct"] < by_expert["gemma-2b-it"] \
        < by_expert["FuseChat-Llama-3.2-3B-Instruct"] < by_expert["FuseChat-Qwen-2.5-7B-Instruct"]
    # decode streams the weights: 2 bytes per parameter over the derated bandwidth
    one_b = load_profile(PAPER_FLEET["FuseChat-Llama-3.2-1B-Instruct"]).step.base_s
    eight_b = load_profile("rtx4090").step.base_s
    assert eight_b / one_b == pytest.approx(8.03 / 1.24, rel=1e-6)


def test_a_kv_cache_smaller_than_max_model_len_shortens_it():
    gemma_7b = load_profile(PAPER_FLEET["gemma-7b-it"])  # 448 KiB of KV per token
    assert gemma_7b.max_model_len < MAX_MODEL_LEN
    assert gemma_7b.max_model_len <= gemma_7b.kv_tokens < gemma_7b.max_model_len + 1024
    assert load_profile("rtx4090").max_model_len == MAX_MODEL_LEN


def test_only_llama_8b_has_a_quantized_build():
    t4 = next(g for g in GPUS if g.name == "t4")
    with pytest.raises(ValueError, match="serves only its own"):
        derive(t4, LLAMA_8B)


@pytest.mark.parametrize("name", sorted(FLEETS))
def test_every_fleet_names_a_profile_per_expert(name):
    mapping = FLEETS[name]
    assert len(mapping) == 6
    for profile in mapping.values():
        assert load_profile(profile).kv_tokens > 0
