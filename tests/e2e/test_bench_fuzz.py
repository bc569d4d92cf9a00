"""``stencil bench fuzz`` end to end, small: its own server, a seed that replays, a soak beside it."""

from __future__ import annotations

import argparse
import json

# Imported here, while nothing else runs: schemathesis is a pytest plugin, so its modules are
# assertion-rewritten (parsed to an AST) when first imported, and CPython 3.11.7's AST conversion
# is not thread-safe (gh-106905): imported later, beside the benchmark's server thread, it raised
# "SystemError: AST constructor recursion depth mismatch" in a test process of make test.
import schemathesis.specs.openapi.schemas  # noqa: F401

from stencil.benchmarks import fuzz


def _run(tmp_path, *argv: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    fuzz.add_arguments(parser)
    out = tmp_path / "fuzz.json"
    rc = fuzz.main(parser.parse_args([*argv, "--json", str(out)]))
    return rc, json.loads(out.read_text())


def test_bench_fuzz_reports_every_case_and_leaves_nothing(tmp_path, default_model_dir):
    rc, report = _run(tmp_path, "--examples", "3", "--seed", "12345", "--modes", "positive,servable",
                      "--operations", "/health,/generate", "--under-soak", "--soak-concurrency", "2",
                      "--soak-round-s", "3")
    assert rc == 0, report["invariants"]
    assert all(report["invariants"].values()) and report["failures"] == 0 == report["responses_5xx"]
    assert report["seed"] == 12345 and "--seed 12345" in report["replay"] and "--under-soak" in report["replay"]
    rows = {(r["mode"], r["operation"]): r for r in report["by_operation_and_mode"]}
    assert set(rows) == {("positive", "GET /health"), ("positive", "POST /generate"), ("servable", "POST /generate")}
    assert rows[("positive", "GET /health")]["examples"] == 1  # no inputs: one distinct case
    assert rows[("servable", "POST /generate")]["examples"] == 3
    assert sum(rows[("servable", "POST /generate")]["statuses"].values()) == 3
    assert report["cases"] == sum(r["examples"] for r in rows.values())
    assert report["soak"]["answered"] > 0 and report["soak"]["errors_5xx"] == 0
    assert report["kv_blocks_free_after"] == report["kv_blocks_total"] and report["requests_left_after"] == 0
