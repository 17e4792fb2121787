import pytest

from proxy.fleet.vllm_metrics import Cumulative, parse_samples, to_stats
from proxy.types import BackendStats

SCRAPE_1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
python_gc_objects_collected_total{generation="0"} 12.0
"""

SCRAPE_2 = SCRAPE_1.replace(
    'time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.0',
    'time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5',
).replace(
    'time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0',
    'time_to_first_token_seconds_count{engine="0",model_name="m"} 12.0',
).replace("queries_total{engine=\"0\",model_name=\"m\"} 1000.0",
          "queries_total{engine=\"0\",model_name=\"m\"} 1100.0"
).replace("hits_total{engine=\"0\",model_name=\"m\"} 250.0",
          "hits_total{engine=\"0\",model_name=\"m\"} 300.0")


def test_parse_sums_engines_and_skips_buckets() -> None:
    samples = parse_samples(SCRAPE_1)
    assert samples["vllm:num_requests_running"] == 4.0
    assert "vllm:time_to_first_token_seconds_bucket" not in samples
    assert not any(k.startswith("python") for k in samples)


def test_interval_means_from_deltas() -> None:
    first, cum = to_stats(parse_samples(SCRAPE_1), Cumulative(), BackendStats(), now=1.0)
    assert first.healthy and first.running == 4 and first.waiting == 2
    assert first.kv_usage == 0.25
    assert first.ttft_s == 0.1 and first.tpot_s == 0.02
    second, cum = to_stats(parse_samples(SCRAPE_2), cum, first, now=2.0)
    assert abs(second.ttft_s - 0.25) < 1e-9  # (1.5-1.0)/(12-10)
    assert second.tpot_s == 0.02  # no new tokens: keeps the last estimate
    assert abs(second.prefix_hit_rate - 0.5) < 1e-9  # 50 hits / 100 queries
    assert second.updated_at == 2.0


def test_counter_reset_starts_over() -> None:
    _, cum = to_stats(parse_samples(SCRAPE_2), Cumulative(), BackendStats(), now=1.0)
    restarted, _ = to_stats(parse_samples(SCRAPE_1), cum, BackendStats(), now=2.0)
    assert restarted.ttft_s == 0.1  # 1.0/10 since the restart


def test_legacy_names() -> None:
    text = ('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:time_per_output_token_seconds_sum{model_name="m"} 1.0\n'
            'vllm:time_per_output_token_seconds_count{model_name="m"} 50\n')
    stats, _ = to_stats(parse_samples(text), Cumulative(), BackendStats(), now=0.0)
    assert stats.kv_usage == 0.5 and stats.tpot_s == 0.02


def test_queue_and_prefill_speed_from_histogram_deltas() -> None:
    def page(queue_sum: float, queue_n: int, prefill_sum: float, prefill_tokens: int) -> str:
        return "\n".join([
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} {queue_sum}',
            f'vllm:request_queue_time_seconds_count{{engine="0"}} {queue_n}',
            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill_sum}',
            f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0"}} {prefill_tokens}',
            ""])

    first, cum = to_stats(parse_samples(page(1.0, 10, 2.0, 1000)), Cumulative(),
                          BackendStats(), 1.0)
    second, _ = to_stats(parse_samples(page(1.6, 12, 2.5, 1500)), cum, first, 2.0)
    assert first.queue_s == pytest.approx(0.1)
    assert second.queue_s == pytest.approx(0.3)  # 0.6 s over 2 new requests
    assert second.prefill_s_per_token == pytest.approx(0.001)  # 0.5 s over 500 tokens


@pytest.mark.parametrize("text", [SCRAPE_1, SCRAPE_2, 'vllm:gpu_cache_usage_perc 0.5\n'
                                  'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'])
def test_line_scan_and_family_jumps_read_the_same(text: str) -> None:
    """Small (filtered) pages are read line by line, whole pages by jumping to each
    family; padding a page past the threshold with unrelated families switches paths."""
    padding = "".join(f'other_family_{i}{{engine="0"}} {i}.0\n' for i in range(400))
    assert len(text) < 8192 < len(text + padding)
    assert parse_samples(text) == parse_samples(text + padding)
    assert parse_samples(text)  # something was read
