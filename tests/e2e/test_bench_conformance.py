"""``stencil bench conformance`` on a corpus of three schemas written here (no ../shared needed)."""

from __future__ import annotations

import json

import pytest

SCHEMAS = {
    "object": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               [({"a": 1}, True), ({"a": -20}, True), ({"a": "x"}, False), ({}, False)]),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2,4}$"},
                [("abc", True), ("abcdef", False), ("A1", False)]),
    # uniqueItems over free strings: not regular, refused up front with the keyword
    "unique": ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, [(["x", "y"], True)]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("maskbench")
    for name, (schema, tests) in SCHEMAS.items():
        (d / f"{name}.json").write_text(json.dumps(
            {"schema": schema, "tests": [{"data": x, "valid": v, "description": ""} for x, v in tests]}))
    return d


@pytest.mark.parametrize("backends", [("eager", "lazy", "auto"), ("lazy", "auto")])
def test_conformance_reports_verdicts_reasons_and_the_steady_state_of_auto(corpus, default_model_dir,
                                                                              backends, tmp_path):
    from stencil.benchmarks.conformance import run_conformance

    failures = tmp_path / "failures.jsonl"
    report = run_conformance(corpus, model_dir=default_model_dir, backends=backends, failures_path=failures,
                             timeout_s=30.0)
    # the object and the pattern schema are handed to llguidance's JSON front end (json_schema.handover)
    assert report["schemas"] == 3 and report["programs"] == {"json": 2}
    for b in backends:
        r = report["backends"][b]
        assert (r["passed"], r["compiled"], r["invalid_accepted"]) == (2, 2, 0), b
        assert r["valid_accepted"] == 3  # two objects and one string
        assert r["errors_by_reason"] == {"error:uniqueItems": 1}
        assert 0 < r["mask_us_p50"] <= r["mask_us_p99"]
        assert 0 < r["first_mask_ms_p50"] <= r["first_mask_ms_p99"]
    auto = report["backends"]["auto"]
    # auto's steady state: the eager index where it was built, else the warm lazy matcher
    expected = (2, 0) if "eager" in backends else (0, 2)
    assert (auto["steady_state_eager"], auto["steady_state_lazy"]) == expected
    assert auto["first_mask_ms_p50"] == report["backends"]["lazy"]["first_mask_ms_p50"]
    lines = [json.loads(x) for x in failures.read_text().splitlines() if x.strip()]
    assert [(x["name"], x["reason"]) for x in lines] == [("unique", "error:uniqueItems")]


def test_maskbench_pairs_masks_over_the_schemas_both_engines_compiled():
    """The harness report's paired block leaves out the schemas only one engine compiled, for
    time to first mask and for masks alike (its per-engine columns keep them)."""
    from stencil.benchmarks.maskbench_harness import _paired, format_table

    ours = {"a": {"ttfm_us": 1000, "all_mask_us": [4, 6]}, "b": {"ttfm_us": 3000, "all_mask_us": [10]},
            "hard": {"ttfm_us": 9000, "all_mask_us": [400, 500]}, "bad": {"compile_error": "x"}}
    theirs = {"a": {"ttfm_us": 2000, "all_mask_us": [8, 12]}, "b": {"ttfm_us": 1000, "all_mask_us": [20]},
              "hard": {"compile_error": "y"}, "bad": {"ttfm_us": 5, "all_mask_us": [1]}}
    p = _paired(ours, theirs)
    assert p["schemas"] == 2
    assert (p["stencil_ttfm_ms_p99"], p["llguidance_ttfm_ms_p99"]) == (3.0, 2.0)  # "hard" and "bad" left out
    assert (p["stencil_mask_us_p50"], p["stencil_mask_us_p99"]) == (6, 10)
    assert (p["llguidance_mask_us_p50"], p["llguidance_mask_us_p99"]) == (12, 20)
    assert (p["mask_ratio_p50"], p["mask_ratio_p99"]) == (0.5, 0.5)
    table = format_table({"engines": {}, "both_compiled": p, "schemas": 4, "whitespace": "flexible", "cpu": "x"})
    assert "mask p50 / p99: Stencil 6 / 10 us, llguidance 12 / 20 us (0.50x / 0.50x)" in table
