"""The examples run, as a user would run them, against a live server on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service_live import tiny_live_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir) as live:
        yield live


def _run(script: str, url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), "--url", url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _run_openai_example(script: str, url: str) -> str:
    """``_run`` for an example that needs the ``openai`` package (skipped without it); its stdout."""
    pytest.importorskip("openai")
    p = _run(script, url)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_typed_client_example(server):
    p = _run("typed_client.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("Person: Person(name=") and lines[1].startswith("Job: Job(person=")
    assert "valid=True" in lines[2]
    assert sum(line.startswith("Async: Person(") for line in lines) == 2


def test_extract_many_example(server):
    p = _run("extract_many.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert [ln for ln in lines if ln.endswith("/4 done")] == [f"{n}/4 done" for n in range(1, 5)]
    results = [ln for ln in lines if ln.startswith("  -> ")]
    assert len(results) == 4  # each text in order, then its span or why none passed
    assert all(r.startswith(("  -> Span(name=", "  -> failed: ")) for r in results)
    assert lines[-2].startswith("The Thirty Years' War")


def test_extract_iter_example(server):
    p = _run("extract_iter.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    items = [ln for ln in lines if ln.startswith("line ")]
    assert 1 <= len(items) <= 4 and all(ln.startswith(f"line {n}: Line(item=") for n, ln in enumerate(items))
    assert lines[-1].startswith("whole answer: {'number': ")


def test_tool_call_example(server):
    out = _run_openai_example("tool_call.py", server.url)
    assert "finish_reason: tool_calls" in out
    assert "model called get_weather({'city': " in out
    assert "answer:" in out


def test_responses_api_example(server):
    out = _run_openai_example("responses_api.py", server.url)
    assert "parsed: Invoice(number='INV-" in out
    assert "response.completed" in out or "response.incomplete" in out


def test_pydantic_tool_example(server):
    out = _run_openai_example("pydantic_tool.py", server.url)
    assert "called: CreateTicket" in out
    assert "ticket: CreateTicket(title=" in out and "priority=<Priority." in out


def test_readme_openai_snippets_are_the_examples_that_run():
    """Every line of the README's OpenAI code blocks is a line of the example it names."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible API"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    sources = {name: (ROOT / "examples" / name).read_text() for name in ("responses_api.py", "pydantic_tool.py")}
    for block, name in zip(blocks, ("responses_api.py", "responses_api.py", "pydantic_tool.py")):
        lines = {ln.strip() for ln in sources[name].splitlines()}
        for line in block.splitlines():
            assert line.strip() in lines, (name, line)


def _run_args(script: str, url: str, *args: str) -> subprocess.CompletedProcess:
    """``_run`` with more arguments (the examples' sizes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), "--url", url, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_invoices_to_csv_example(server, tmp_path):
    import csv

    out = tmp_path / "invoices.csv"
    p = _run_args("invoices_to_csv.py", server.url, "--count", "3", "--output", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(p.stdout.splitlines()))
    assert p.stdout == out.read_text()
    assert sorted(r["key"] for r in rows) == ["invoice-01.txt", "invoice-02.txt", "invoice-03.txt"]
    assert list(rows[0]) == ["key", "number", "date", "vendor", "total", "currency", "valid", "error"]
    for r in rows:  # the tiny model's fields are nonsense, but of the schema's types and shapes
        assert r["valid"] == "true" and r["error"] == "", r
        float(r["total"])
        assert r["currency"] in ("EUR", "USD", "GBP", "CHF") and len(r["date"]) == 10
    assert "fields as written in the invoices" in p.stderr


def test_batch_corpus_example(server, tmp_path):
    p = _run_args("batch_corpus.py", server.url, "--count", "20", "--concurrency", "4", "--folder", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    held = int(lines[0].split()[2])  # "interrupted with N of 20 lines answered"
    assert lines[0].startswith("interrupted with ") and 8 <= held < 20
    assert f"({held} already in OUTPUT)" in lines[1] and lines[1].startswith(f"stencil batch: {20 - held} lines")
    assert lines[-1] == f"20 texts: 20 answered, 20 valid, 0 answered twice ({tmp_path / 'answers.jsonl'})"
    records = [json.loads(x) for x in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(f"t{n}" for n in range(20))
