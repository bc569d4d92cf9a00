"""``stencil bench batch`` against a live Stencil on the tiny model: the report's fields and values, for
the throughput comparison and for the killed-and-resumed run (not its timings)."""

from __future__ import annotations

import argparse
import json

import pytest

from stencil.benchmarks import batch as bench_batch
from service_live import tiny_live_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir, num_kv_blocks=256) as live:
        yield live


def test_reports_both_clients_and_a_resume_equal_to_one_run(server, tmp_path):
    p = argparse.ArgumentParser()
    bench_batch.add_arguments(p)
    args = p.parse_args(["--base-url", server.url, "--lines", "12", "--concurrency", "4", "--rounds", "2",
                         "--mode", "both", "--kills", "3", "--seed", "1", "--max-tokens", "48",
                         "--json", str(tmp_path / "batch.json")])
    assert bench_batch.main(args) == 0
    report = json.loads(args.json.read_text())
    assert (report["lines"], report["concurrency"], report["model"], report["route"]) == (
        12, 4, "tiny", "/v1/chat/completions")
    t = report["throughput"]
    assert [(r["client"], r["round"], r["requests"]) for r in t["runs"]] == [
        ("batch", 1, 6), ("serve", 1, 6), ("serve", 2, 6), ("batch", 2, 6)]
    for client in ("batch", "serve"):
        # a finished answer of the tiny model is always valid: the grammar closes it within max_tokens
        assert t[client]["errors"] == 0 and t[client]["valid_fraction"] == 1.0 and t[client]["requests_per_s"] > 0
    assert t["ratio_requests_per_s"] == pytest.approx(t["batch"]["requests_per_s"] / t["serve"]["requests_per_s"])
    r = report["resume"]
    assert r["kill_points"] == sorted(r["kill_points"]) and len(r["kill_points"]) == 3
    assert all(1 <= k < 12 for k in r["kill_points"])
    # each kill lands once the output holds its point (a few more may finish before the signal does)
    assert all(held >= k for held, k in zip(r["lines_after_each_kill"], r["kill_points"]))
    assert r["every_line_answered_once"] is True and r["valid_fraction"] == 1.0
    assert r["same_as_uninterrupted"] == 12  # greedy: the same answers however the run was cut


def test_batch_lines_are_bench_serves_bodies_unstreamed():
    from stencil.benchmarks import serve

    jobs, _ = serve.workload_jobs("person", 3)
    lines = [json.loads(x) for x in bench_batch.batch_lines(jobs, "m", 64)]
    assert [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    for line, job in zip(lines, jobs):
        assert line["method"] == "POST" and line["url"] == "/v1/chat/completions"
        assert line["body"] == serve.request_body(job, "m", 64, stream=False) and "stream" not in line["body"]
