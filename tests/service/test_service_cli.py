"""The ``stencil`` command line: help texts, lazy benchmark dispatch, one-shot generate."""

from __future__ import annotations

import re
import sys
import types

import pytest

from stencil.service import cli


@pytest.mark.parametrize("argv, needle", [
    ([], "serve"),
    (["serve"], "--api-key"),
    (["generate"], "--schema"),
    (["bench"], "soak"),
])
def test_help_everywhere(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    assert needle in capsys.readouterr().out


def test_bench_dispatches_lazily(monkeypatch, capsys):
    seen = {}
    fake = types.ModuleType("stencil.benchmarks.fake_bench")
    fake.add_arguments = lambda p: p.add_argument("--n", type=int, default=1)
    fake.main = lambda args: seen.setdefault("n", args.n) and 3
    monkeypatch.setitem(sys.modules, "stencil.benchmarks.fake_bench", fake)
    assert cli.main(["bench", "fake_bench", "--n", "5"]) == 3
    assert seen == {"n": 5}
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert "not available" in capsys.readouterr().err


def test_generate_one_shot(tiny_model_dir, capsys):
    rc = cli.main(["generate", "--model", str(tiny_model_dir), "--num-kv-blocks", "64",
                   "--regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "When?"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\n", out.out)
    assert "loading model" in out.err and "finish_reason=stop" in out.err


def test_generate_sends_a_base_models_prompt_as_it_is(tmp_path, capsys):
    """A model without a chat template continues PROMPT (as with --raw) instead of refusing
    after the load with the HTTP API's advice."""
    from stencil.engine.models.default_model import fetch_gguf
    from gguf_testing import smol_vocab, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "base.gguf", "llama", smol_vocab(fetch_gguf()), seed=2, chat_template=None)[0]
    rc = cli.main(["generate", "--model", str(gguf), "--num-kv-blocks", "64", "--regex", "[0-9]{3}", "Digits:"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert re.fullmatch(r"[0-9]{3}\n", out.out)
    assert "no chat template: PROMPT is sent as it is" in out.err


def test_generate_reports_bad_schema(tiny_model_dir, tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "strin"}')
    rc = cli.main(["generate", "--model", str(tiny_model_dir), "--num-kv-blocks", "64", "--schema", str(schema), "x"])
    assert rc == 2 and "error (400)" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_listed_benchmark_has_its_module(name):
    """``stencil bench --help`` lists it, so ``stencil bench NAME`` must find a module with the
    two entry points (read from the source: importing some pulls in Ray)."""
    import importlib.util

    spec = importlib.util.find_spec(cli.benchmark_module(name))
    assert spec is not None and spec.origin, name
    source = open(spec.origin, encoding="utf-8").read()
    assert "def add_arguments(" in source and "def main(" in source, name


def test_activation_precision_and_the_hybrid_cache_reach_the_engine_config(tiny_model_dir):
    from stencil.engine.config import ConfigError, EngineConfig

    args = cli.build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--activation-precision", "int8"])
    assert cli.engine_config_from_args(args).activation_precision == "int8"
    args = cli.build_parser().parse_args(["serve", "--model", str(tiny_model_dir)])
    assert cli.engine_config_from_args(args).activation_precision == "exact"
    assert cli.engine_config_from_args(args).hybrid_kv_cache is True
    args = cli.build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--no-hybrid-kv-cache"])
    assert cli.engine_config_from_args(args).hybrid_kv_cache is False
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--activation-precision", "int4"])
    with pytest.raises(ConfigError, match="activation_precision"):
        EngineConfig(model=tiny_model_dir, activation_precision="fp8").validate()
