"""``stencil bench tools`` (tool-call grammars at agent scale): the functions it builds, and the
whole command on the tiny model with a short context (report rows, part counts, statuses and
ratios present; never timing values)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from stencil.benchmarks import tools
from stencil.grammar.tool_calls import tool_call_spec
from conftest import shared_corpora


def test_generated_functions_nest_defs_and_are_seeded():
    a = tools.generated_function(7, random.Random(3))
    assert a == tools.generated_function(7, random.Random(3))
    params = a["parameters"]
    assert set(params["$defs"]) == {"Item", "Address", "Order"}
    assert params["properties"]["order"] == {"$ref": "#/$defs/Order"}
    assert params["$defs"]["Order"]["properties"]["items"]["items"] == {"$ref": "#/$defs/Item"}
    spec, _ = tool_call_spec(tools._calls([a]))
    assert spec.kind == "regex"


def test_bfcl_types_are_written_as_json_schema():
    got = tools._json_schema({"type": "dict", "properties": {"x": {"type": "float"}, "y": {"type": "any"},
                                                             "z": {"type": "tuple", "items": {"type": "String"}}},
                              "required": ["x"]})
    assert got == {"type": "object", "properties": {"x": {"type": "number"}, "y": {},
                                                    "z": {"type": "array", "items": {"type": "string"}}},
                   "required": ["x"]}


def test_the_sizes_extend_one_list():
    small, origin = tools.tool_functions(6, None, seed=0)
    large, _ = tools.tool_functions(9, None, seed=0)
    assert large[:6] == small and origin == {"bfcl": 0, "generated": 6, "bfcl_refused": 0}


def test_bench_tools_end_to_end_on_the_tiny_model(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    corpus = shared_corpora()
    bfcl = corpus / "bfcl" if corpus is not None and (corpus / "bfcl").is_dir() else tmp_path / "no-corpus"
    parser = argparse.ArgumentParser()
    tools.add_arguments(parser)
    out = tmp_path / "tools.json"
    args = parser.parse_args(["--tools", "3,5", "--corpus", str(bfcl), "--model", str(model), "--json", str(out)])
    assert tools.main(args) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert [r["tools"] for r in report["rows"]] == [3, 5]
    assert report["max_model_len"] == 1024 and 1 <= report["fits_up_to"] < 500
    for r in report["rows"]:
        assert r["form"] == "regex" and r["part_compiles"] == r["tools"] + 1  # the list, then one more
        assert all(r[k] > 0 for k in ("cold_ms", "warm_ms", "extended_ms", "first_mask_ms", "cold_over_single"))
        if r["fits"]:
            assert r["ttft_ratio"] > 0 and r["prompt_tokens"] < 1024
        else:
            assert "ttft_ratio" not in r
    statuses = {r["tools"]: r["status"] for r in report["service"]}
    fit = report["fits_up_to"]
    assert statuses[fit] == 200 and statuses[fit + 1] == 400 and all(r["ok"] for r in report["service"])
    over = next(r for r in report["service"] if r["tools"] == fit + 1)
    assert over["names_context"] and "max_model_len 1024" in over["error"]
    assert "cold_over_single" in printed and f"up to {fit} of these functions fit" in printed
