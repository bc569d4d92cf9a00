"""A short soak in CI: ``stencil bench soak`` on the tiny model, and its invariants.

A reference phase of 4 clients, then two rounds of about 12 s of mixed load (both endpoints, constrained or not, streamed or not, clients that
hang up or give up, requests with a short queue_timeout) from 12 clients against a server with
4 running slots and a waiting queue of 2, so 429s happen too, while a probe process times
/health and /metrics. The benchmark itself checks the invariants and exits 1 if one fails;
this test also reads its JSON report.
"""

from __future__ import annotations

import argparse
import json

from stencil.benchmarks import soak

KEYS = {"concurrency", "sent", "answered", "aborted", "rejected_429", "errors_5xx", "transport_errors",
        "latency_ms_p50", "latency_ms_p99", "kv_blocks_total", "kv_blocks_free_after", "requests_left_after",
        "health_ms_p99", "metrics_ms_p99", "peak_rss_mb", "answered_share"}


def test_short_soak_leaves_nothing_behind(tmp_path, default_model_dir):
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    out = tmp_path / "soak.json"
    args = parser.parse_args(["--duration", "12", "--rounds", "2", "--reference-concurrency", "4", "--rest-s", "0",
                              "--reference-duration", "4", "--concurrency", "12", "--model", "tiny", "--max-num-seqs", "4",
                              "--max-waiting", "2", "--num-kv-blocks", "256", "--max-tokens", "24",
                              # A loaded CI machine must not fail the run on timing: the bounds on
                              # probe latency and on the share answered are for the benchmark.
                              "--max-health-ms", "0", "--min-answered-share", "0", "--ramp", "1",
                              "--max-peak-rss-ratio", "0", "--max-round-rss-ratio", "0",
                              "--json", str(out)])
    rc = soak.main(args)
    report = json.loads(out.read_text())
    assert rc == 0, report["invariants"]
    assert KEYS <= set(report)
    assert all(report["invariants"].values()), report["invariants"]
    assert report["kv_blocks_free_after"] == report["kv_blocks_total"] == 256
    assert report["requests_left_after"] == 0
    outcomes = ("answered", "aborted", "rejected_429", "errors_4xx", "errors_5xx", "transport_errors")
    assert report["sent"] == sum(report[k] for k in outcomes) > 0
    assert report["answered"] > 0 and report["aborted"] > 0 and report["rejected_429"] > 0, report
    assert report["errors_5xx"] == report["transport_errors"] == report["errors_4xx"] == 0, report["unexpected"]
    assert 0 < report["latency_ms_p50"] <= report["latency_ms_p99"]
    assert report["probes"] > 10 and report["probe_failures"] == 0 and 0 < report["health_ms_p99"]
    assert report["concurrency"] == 12
    ref, rounds = report["reference"], report["rounds"]
    assert ref["concurrency"] == 4 and [r["concurrency"] for r in rounds] == [12, 12]
    assert report["sent"] == sum(r["sent"] for r in rounds) and ref["sent"] > 0
    assert 0 < ref["running_max"] <= 4 and max(r["waiting_max"] for r in rounds) > 0
    assert all(0 < r["rss_end_mb"] <= r["peak_rss_mb"] for r in [ref, *rounds])
    assert report["peak_rss_ratio"] == round(max(r["peak_rss_mb"] for r in rounds) / ref["peak_rss_mb"], 4)
    assert report["round_rss_ratio"] == round(rounds[1]["rss_end_mb"] / rounds[0]["rss_end_mb"], 4)
    assert report["peak_rss_mb"] > 0 and report["server_exit_code"] == 0
    times = [t for t, _ in report["rss_timeline_mb"]]
    assert len(times) >= 3 and times == sorted(times)
    assert 0 < report["rss_half_mb"] <= report["peak_rss_mb"]
    assert report["rss_growth_mb"] == report["rss_load_end_mb"] - report["rss_half_mb"]
    # Every kind of request was sent.
    kinds = " ".join(report["by_kind"])
    for part in ("/generate", "/v1/chat/completions", "schema", "regex", "choice", "stream", "plain"):
        assert part in kinds, report["by_kind"]


def test_in_band_stream_errors_are_counted_by_their_status():
    ev = lambda **e: "data: " + json.dumps(e)
    assert soak._stream_failed(ev(error={"type": "timeout", "message": "ran past its deadline"})) == 504
    assert soak._stream_failed(ev(error={"type": "server_error", "message": "x"})) == 500
    assert soak._stream_failed(ev(error={"type": "invalid_request_error", "message": "x"})) == 400
    assert soak._stream_failed(ev(type="error", error={"status": 503})) == 503
    assert soak._stream_failed(ev(choices=[])) is None
