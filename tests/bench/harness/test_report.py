"""Reports: every number checked against a hand computation on small synthetic runs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.__main__ import main
from bench.harness.plots import inflight_series
from bench.harness.report import QosConfig, git_commit, pct, summarize
from bench.harness.results import Migration, RequestResult, RunFile, read, writing
from bench.harness.solo import SoloLatencies
from bench.harness.tables import latency_table, slo_table

QUALITY = {"e1": 0.8, "e2": 0.4}


def result(seq: int, sent: float, e2e: float, ttft: float | None, out: int | None,
           backend: str, error: str | None = None, **kw: Any) -> RequestResult:
    return RequestResult(
        seq, "abcd"[seq], "m", float(seq), sent, e2e, ttft, 0.01 * (seq + 1),
        (ttft,) if ttft is not None else (), 5 if out else None, out, out or 8, backend,
        200, error, quality=QUALITY, **kw)


# sent 0..3; duration = max(sent + e2e) - min(sent) = 3 + 4 = 7 s
RESULTS = (
    result(0, 0.0, 1.0, 0.1, 10, "b1"),
    result(1, 1.0, 2.0, 0.3, 20, "b2"),
    result(2, 2.0, 0.5, 0.2, 5, "b1",
           migrations=(Migration("b1", "b2", 2, "risk", 0.25),)),
    result(3, 3.0, 4.0, None, None, "b2", error="HTTP 502: boom"),
)
RUN = RunFile(Path("least.jsonl"), {"label": "least", "policy": "least_request"}, RESULTS)
SOLO = SoloLatencies({"a": 0.5, "b": 1.5, "c": 0.5})


def solo_result(request_id: str, e2e: float, prompt: int = 5, out: int = 10) -> RequestResult:
    return RequestResult(0, request_id, "m", 0.0, 0.0, e2e, 0.01, 0.001, (0.01,), prompt, out,
                         out, "b1", 200)


def test_throughput_and_percentiles() -> None:
    s = summarize(RUN)
    assert (s.requests, s.errors, s.migrations) == (4, 1, 1)
    assert s.duration_s == 7.0
    assert s.throughput_rps == pytest.approx(3 / 7)
    assert s.output_tokens_per_s == pytest.approx(35 / 7)
    assert s.offered_rps == pytest.approx(1.0)  # (4 - 1) arrivals over 3 s
    # sorted TTFTs 0.1, 0.2, 0.3: p90 sits at rank 1.8 → 0.2 + 0.8 x 0.1
    assert s.ttft_s == pytest.approx((0.2, 0.28, 0.298))
    assert s.e2e_s == pytest.approx((1.0, 1.8, 1.98))  # sorted 0.5, 1, 2
    assert s.tpot_s == pytest.approx((0.02, 0.028, 0.0298))  # failed request left out


def test_slo_attainment_and_goodput_per_scale() -> None:
    s = summarize(RUN, SOLO, scales=(1.0, 1.5, 2.0))
    # e2e / solo: a 1/0.5, b 2/1.5, c 0.5/0.5; d failed (a miss at every scale)
    assert s.slo_requests == 4
    assert [(p.scale, p.attainment) for p in s.slo] == [(1.0, 0.25), (1.5, 0.5), (2.0, 0.75)]
    assert [p.goodput_rps for p in s.slo] == pytest.approx([1 / 7, 2 / 7, 3 / 7])


def test_requests_without_a_solo_latency_are_left_out_of_the_slo() -> None:
    s = summarize(RUN, SoloLatencies({"a": 0.5}), scales=(2.0,))
    assert s.slo_requests == 2  # a, and the failed d; b and c have no solo and no fit
    assert s.slo[0].attainment == 0.5 and s.slo[0].goodput_rps == pytest.approx(1 / 7)


def test_qos_is_score_times_latency_per_token_indicator() -> None:
    config = QosConfig(0.15, {"b1": "e1", "b2": "e2"})
    # a: e1 0.8, 0.1 s/token; b: e2 0.4, 0.1; c: migrated to b2 → e2 0.4, 0.1; d failed → 0
    assert summarize(RUN, qos_config=config).qos == pytest.approx((0.8 + 0.4 + 0.4) / 4)
    strict = QosConfig(0.09, {"b1": "e1", "b2": "e2"})
    assert summarize(RUN, qos_config=strict).qos == 0.0
    assert summarize(RUN).qos is None  # no backend is named after an expert
    named = RunFile(RUN.path, RUN.header, (result(0, 0.0, 1.0, 0.1, 10, "e2"),))
    assert summarize(named, qos_config=QosConfig(0.15)).qos == pytest.approx(0.4)


def test_solo_is_the_median_of_repeats_and_a_fit_for_unmeasured_requests() -> None:
    samples = [solo_result("a", e) for e in (0.9, 0.4, 0.5)]
    shapes = [(10, 5), (50, 20), (200, 8), (120, 40)]
    samples += [solo_result(f"s{i}", 0.2 + 0.001 * p + 0.05 * o, p, o)
                for i, (p, o) in enumerate(shapes)]
    solo = SoloLatencies.from_results(samples)
    assert solo.measured["a"] == 0.5
    assert solo.estimate("new", 100, 10) == pytest.approx(0.2 + 0.1 + 0.5, abs=0.05)
    assert solo.estimate("new", None, 10) is None
    assert SoloLatencies.from_results(samples[:2]).estimate("new", 100, 10) is None


def test_a_median_slo_base_gives_every_request_one_deadline() -> None:
    """The paper's 'median request execution time' reading: one base for all, the
    median of the measured solo latencies (0.5 of 0.5, 1.5, 0.5), measured or not."""
    median = SOLO.based_on("median")
    assert [median.estimate(k, None, None) for k in ("a", "b", "never")] == [0.5] * 3
    assert SOLO.based_on("request") is SOLO
    s = summarize(RUN, median, scales=(1.0, 2.0, 4.0))
    # e2e 1, 2, 0.5 against 0.5 x scale; b now misses at 2 (it met its own 1.5 x 2)
    assert s.slo_requests == 4
    assert [p.attainment for p in s.slo] == [0.25, 0.5, 0.75]
    with pytest.raises(ValueError, match="unknown SLO base"):
        SOLO.based_on("mean")
    with pytest.raises(ValueError, match="no solo latency measured"):
        SoloLatencies({}).based_on("median")


def test_inflight_series_follows_requests_and_migrations() -> None:
    series = inflight_series(RESULTS)
    assert series["b1"] == [(0.0, 1), (1.0, 0), (2.0, 1), (2.25, 0)]
    assert series["b2"] == [(1.0, 1), (2.25, 2), (2.5, 1), (3.0, 0), (3.0, 1), (7.0, 0)]


def test_tables_put_runs_side_by_side() -> None:
    other = RunFile(Path("rr.jsonl"), {"policy": "round_robin"}, RESULTS[:2])
    summaries = [summarize(RUN, SOLO, (1.0, 2.0)), summarize(other, SOLO, (1.0, 2.0))]
    latency = latency_table(summaries).splitlines()
    assert latency[2].startswith("| least | least_request | 4 | 1 | 1 | 7.0 | 1.00 | 0.43 |")
    assert "| 200 / 280 / 298 |" in latency[2]
    assert latency[3].startswith("| rr | round_robin | 2 |")
    slo = slo_table(summaries).splitlines()
    assert slo[2] == "| least | least_request | 4 | 0.143 (25) | 0.429 (75) |"
    assert slo_table([summarize(RUN)]) == ""


def write_run(path: Path, header: dict[str, Any], rows: tuple[RequestResult, ...]) -> None:
    with writing(path) as writer:
        writer.header(header)
        for row in rows:
            writer(row)


def test_result_files_round_trip(tmp_path: Path) -> None:
    write_run(tmp_path / "r.jsonl", {"label": "x", "policy": "p"}, RESULTS)
    back = read(tmp_path / "r.jsonl")
    assert back.results == RESULTS and back.name == "x" and back.policy == "p"


def test_report_command_writes_tables_and_pngs(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "least.jsonl", {"label": "least", "policy": "least_request"}, RESULTS)
    write_run(tmp_path / "rr.jsonl", {"label": "rr", "policy": "round_robin"}, RESULTS[:3])
    write_run(tmp_path / "solo.jsonl", {"label": "solo", "mode": "solo"},
              tuple(solo_result(k, v) for k, v in SOLO.measured.items()))
    out = tmp_path / "report"
    code = main(["report", str(tmp_path / "least.jsonl"), str(tmp_path / "rr.jsonl"),
                 "--solo", str(tmp_path / "solo.jsonl"), "--scales", "1,2", "--out-dir",
                 str(out), "--expert-map", "b1=e1", "--expert-map", "b2=e2",
                 "--qos-latency-ms", "150"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| least | least_request | 4 | 1 |" in printed and "| rr | round_robin | 3 |" in printed
    assert "| least | least_request | 4 | 0.143 (25) | 0.429 (75) |" in printed
    assert (out / "report.md").read_text().strip() in printed
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary[0]["qos"] == pytest.approx(0.4) and summary[1]["requests"] == 3
    median = main(["report", str(tmp_path / "least.jsonl"), "--solo",
                   str(tmp_path / "solo.jsonl"), "--scales", "1,2", "--slo-base", "median",
                   "--out-dir", str(tmp_path / "median")])
    # one deadline of 0.5 x scale: of e2e 1, 2, 0.5 (and a failure) 1 met at 1, 2 at 2
    assert median == 0 and "| least | least_request | 4 | 0.143 (25) | 0.286 (50) |" \
        in capsys.readouterr().out
    pngs = ["ttft_cdf", "tpot_cdf", "backend_load", "goodput_vs_slo_scale", "goodput_vs_load"]
    for name in pngs:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_pct_is_the_nearest_rank_an_observed_value() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [pct(values, q) for q in (0.0, 0.5, 0.99, 1.0)] == [1.0, 3.0, 5.0, 5.0]
    assert pct([1.0, 2.0], 0.5) == 2.0  # no interpolation (1.5)


def test_git_commit_is_the_checked_out_commit_whole_or_short() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit() == head and len(head) == 40
    assert head.startswith(git_commit(short=True)) and 4 <= len(git_commit(short=True)) < 40
