"""The peers comparison's table (``benchmarks.peers.run``), from synthetic ``bench serve`` reports;
building and running llama-server itself is the script's job, not the test suite's."""

from __future__ import annotations

from benchmarks.peers.run import table

S, L = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _run(stencil_rps: list[float], llama_rps: list[float]) -> dict:
    rows = []
    for c, a, b in zip((1, 8), stencil_rps, llama_rps):
        rows.append({"concurrency": c, "results": {
            S: {"requests_per_s": a, "latency_ms_p50": 1000 * c / a, "valid_fraction": 1.0},
            L: {"requests_per_s": b, "latency_ms_p50": 1000 * c / b, "valid_fraction": 0.5}}})
    return {"throughput": rows}


def test_table_gives_requests_per_second_latency_and_ratio_as_ranges_over_runs():
    text = table([_run([4.0, 8.0], [2.0, 4.0]), _run([5.0, 8.0], [2.0, 5.0])], S, L)
    lines = text.splitlines()
    assert lines[0].startswith("| concurrency | llama-server req/s")
    assert lines[2] == "| 1 | 2.00 (0.50 s) | 4.00-5.00 (0.20-0.25 s) | 2.00-2.50x | 0.50 / 1.00 |"
    assert lines[3] == "| 8 | 4.00-5.00 (1.60-2.00 s) | 8.00 (1.00 s) | 1.60-2.00x | 0.50 / 1.00 |"
