"""``stencil bench slowclients`` on the tiny model: its mechanics, not its latency ratio.

Dribbling connections are closed by the server's header time-out with a 408, a client reading
a byte a second is dropped at the send time-out, the normal clients are all answered, and
nothing is left in the engine. The ITL ratio (the benchmark's target) depends on the machine's
load, so it is not checked here (``--max-itl-ratio 0``).
"""

from __future__ import annotations

import argparse
import json

from stencil.benchmarks import slowclients


def test_slow_clients_are_timed_out_and_the_rest_answered(tmp_path, default_model_dir):
    parser = argparse.ArgumentParser()
    slowclients.add_arguments(parser)
    out = tmp_path / "slow.json"
    args = parser.parse_args(["--model", "tiny", "--clients", "2", "--requests", "1", "--max-tokens", "16",
                              "--slow-headers", "10", "--header-timeout", "1", "--send-timeout", "1",
                              "--slow-max-tokens", "256", "--server-arg=--send-buffer-bytes=8192",
                              "--server-arg=--write-buffer-bytes=8192", "--max-itl-ratio", "0",
                              "--rounds", "2", "--json", str(out)])
    rc = slowclients.main(args)
    report = json.loads(out.read_text())
    assert rc == 0, report["invariants"]
    assert all(report["invariants"].values()), report["invariants"]
    heads = report["attacks"][0]["slow_headers"]
    assert heads["closed_by_server"] >= 10 and heads["answered_408"] == heads["closed_by_server"]
    assert 1.0 <= heads["held_s_p50"] <= heads["held_s_max"]  # never before the header time-out
    readers = report["attacks"][0]["slow_readers"]
    assert readers["dropped"] >= 1 and readers["completed"] == 0
    assert [r["order"] for r in report["rounds_detail"]] == ["idle, attacked", "attacked, idle"]
    assert len(report["attacks"]) == 2
    for phase in ("idle", "attacked"):
        assert report[phase]["answered"] == 4 and report[phase]["failed"] == 0
        assert report[phase]["itl_samples"] > 0 and report[phase]["itl_ms_p50"] > 0
    assert report["itl_p50_ratio"] > 0
    assert report["kv_blocks_free_after"] == report["kv_blocks_total"]
