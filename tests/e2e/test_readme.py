"""The README's commands run as written.

The curl of "Ask for JSON" is sent, unchanged but for the address, to a live server on the tiny model, and its
answer has the keys the README shows; ``stencil generate`` runs the README's line on the tiny model; every other
``stencil`` command line is parsed as the command line reads it (a benchmark's own options included), so an option
the README names cannot be renamed away from it. Every shell line of the README must be one of the kinds checked
here, so a new command cannot slip in untested. The Python blocks are the examples' own lines
(``tests/e2e/test_examples.py``), and the examples run there and in ``tests/service/test_service_server.py``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_examples
from stencil.service import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
README_ADDRESS = "http://127.0.0.1:8000"
server = test_examples.server  # the fixture: the examples' live server on the tiny model, shared


def shell_lines() -> list[str]:
    """Every command of the README's ``sh`` blocks: continuations joined, comments and output lines dropped."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        if block.startswith("curl "):  # one command whose quoted body spans lines
            lines.append(block.strip())
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def curl_command() -> str:
    """The README's curl (one command over several lines: its body is quoted)."""
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", README, re.S) if b.startswith("curl ")]
    return block


def shown_answer() -> dict:
    """The answer the README pastes under its curl."""
    (answer,) = re.findall(r"```json\n(.*?)```", README, re.S)
    return json.loads(answer)


def _stencil_argv(line: str) -> list[str] | None:
    """The arguments after ``stencil`` of a README line that runs it, else None."""
    words = shlex.split(line)
    if words[0] in ("stencil", ".venv/bin/stencil"):
        return words[1:]
    return None


def test_every_shell_line_is_of_a_checked_kind():
    """make targets, the curl, ``stencil ...``, pytest on a path and the examples: nothing else."""
    kinds = {}
    for line in shell_lines():
        if line.startswith("curl "):
            kinds[line] = "curl"
        elif line.startswith("make "):
            target = line.split()[1]
            assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), line
            kinds[line] = "make"
        elif _stencil_argv(line) is not None:
            kinds[line] = "stencil"
        elif line.startswith(".venv/bin/pytest "):
            paths = [w for w in shlex.split(line)[1:] if w.startswith("tests/")]
            assert paths and all((ROOT / p).exists() for p in paths), line
            kinds[line] = "pytest"
        elif line.startswith(".venv/bin/python examples/"):
            assert (ROOT / shlex.split(line)[1]).is_file(), line
            kinds[line] = "example"
        else:
            kinds[line] = None
    assert [line for line, kind in kinds.items() if kind is None] == []
    assert set(kinds.values()) == {"curl", "make", "stencil", "pytest", "example"}


def test_every_stencil_line_parses_with_its_benchmark_options():
    parsed = []
    for line in shell_lines():
        argv = _stencil_argv(line)
        if argv is None:
            continue
        args = cli.build_parser().parse_args(argv)
        if args.command == "bench":
            module = importlib.import_module(cli.benchmark_module(args.name))
            parser = cli.argparse.ArgumentParser(prog=f"stencil bench {args.name}")
            module.add_arguments(parser)
            parser.parse_args(args.bench_args)
        parsed.append(args.command)
    assert sorted(set(parsed)) == ["batch", "bench", "extract", "generate", "serve"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_readme_curl_answers_with_the_keys_it_shows(server):
    command = curl_command()
    assert README_ADDRESS in command
    p = subprocess.run(["bash", "-c", command.replace(README_ADDRESS, server.url)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    shown = shown_answer()
    assert set(answer) == set(shown)
    assert set(answer["usage"]) == set(shown["usage"]) and set(answer["timings"]) == set(shown["timings"])
    # the tiny model's words are random, but the grammar holds its answer to the schema, closed in time
    assert answer["valid"] is True and answer["finish_reason"] == "stop"
    assert set(answer["output"]) == {"name", "age", "city"} and isinstance(answer["output"]["age"], int)
    assert shown["valid"] is True and shown["output"] == {"name": "John Smith", "age": 42, "city": "Paris"}


def test_the_readme_generate_line_runs(tiny_model_dir):
    """``stencil generate --schema examples/person.json PROMPT`` as the README writes it, from the repository
    root, on the tiny model: the file is the curl's schema, and exit 0 means the output is valid."""
    (line,) = [ln for ln in shell_lines() if (_stencil_argv(ln) or [""])[0] == "generate"]
    argv = _stencil_argv(line)
    schema_file = ROOT / argv[argv.index("--schema") + 1]
    body = re.search(r"-d '(.*)'", curl_command(), re.S).group(1)
    assert json.loads(schema_file.read_text()) == json.loads(body)["response_schema"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "stencil.service.cli", *argv, "--model", str(tiny_model_dir),
                        "--max-tokens", "64"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(json.loads(p.stdout)) == {"name", "age", "city"}  # the output, as JSON
