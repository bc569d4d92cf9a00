"""``stencil batch``: every line answered, bad lines as error lines, a killed run resumed to the same lines,
and ``--url`` against a live server, on the tiny model with greedy decoding."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

from stencil.service import batch
from stencil.service.cli import main
from service_live import TINY_MODEL_NAME, tiny_live_server

GOOD = 18  # lines that reach the model
BAD = {  # custom_id under which each bad line is answered -> the error code it gets
    "line-19": "invalid_json", "line-20": "invalid_line", "get": "invalid_line", "embed": "invalid_url",
    "stream": "invalid_line",
}
# Per-run values: ids, clocks, and the counters of prefix-cache hits and n-gram drafts, which depend on what
# ran beside and before (the text does not).
VOLATILE = {"id", "created", "created_at", "completed_at", "request_id", "timings", "cached_tokens",
            "draft_tokens", "accepted_tokens"}


def _lines() -> list[str]:
    reqs = []
    for i in range(12):
        reqs.append(("/generate", {"prompt": f"item {i}:", "regex": "[a-z]+( [a-z]+)*", "max_tokens": 12,
                                   "temperature": 0}))
    for i in range(3):
        reqs.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}],
                                              "max_tokens": 8, "temperature": 0}))
    reqs.append(("/v1/completions", {"prompt": "once upon", "max_tokens": 8, "temperature": 0}))
    reqs.append(("/v1/responses", {"input": "hello", "max_output_tokens": 8, "temperature": 0}))
    reqs.append(("/generate", {"prompt": "x", "max_tokens": -3}))  # the server's 422
    lines = [json.dumps({"custom_id": f"q{n}", "method": "POST", "url": url, "body": body})
             for n, (url, body) in enumerate(reqs)]
    assert len(lines) == GOOD
    return lines + [
        "{not json",
        json.dumps({"method": "POST", "url": "/generate", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/generate", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "stream", "method": "POST", "url": "/generate",
                    "body": {"prompt": "x", "stream": True}}),
        lines[0],  # q0 again: a duplicate
        "",
    ]


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _norm(x):
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    return x


def _by_id(records: list[dict]) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in records:
        out.setdefault(r["custom_id"], []).append(_norm(r))
    return out


def _engine_args(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--model-name", TINY_MODEL_NAME, "--num-kv-blocks", "64",
            "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def input_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("\n".join(_lines()) + "\n")
    return path


@pytest.fixture(scope="module")
def reference(input_file, tiny_model_dir):
    """One uninterrupted in-process run, 4 in flight: (output path, its records)."""
    out = input_file.parent / "reference.jsonl"
    assert main(["batch", str(input_file), str(out), "--concurrency", "4", *_engine_args(tiny_model_dir)]) == 0
    return out, _read(out)


def test_every_line_answered_and_bad_lines_are_error_lines(reference, input_file, tiny_model_dir, capsys):
    out, records = reference
    got = Counter(r["custom_id"] for r in records)
    assert got == Counter({**{f"q{n}": 1 for n in range(GOOD)}, "q0": 2, **{k: 1 for k in BAD}})
    answered = {r["custom_id"]: r for r in records if r["response"] is not None}
    assert {k: r["response"]["status_code"] for k, r in answered.items()} == {
        **{f"q{n}": 200 for n in range(GOOD - 1)}, f"q{GOOD - 1}": 422}
    assert all(r["error"] is None and r["id"].startswith("batch_req_") for r in answered.values())
    for n in range(12):  # /generate answers match their regex
        body = answered[f"q{n}"]["response"]["body"]
        assert body["valid"] is True and body["text"], body
    assert answered["q12"]["response"]["body"]["object"] == "chat.completion"
    assert answered["q17"]["response"]["body"]["field"] == "max_tokens"
    errors = {r["custom_id"]: r["error"]["code"] for r in records if r["response"] is None}
    assert errors == {**BAD, "q0": batch.DUPLICATE}
    # A second run finds everything answered: it adds nothing (and loads no model).
    before = out.read_bytes()
    capsys.readouterr()
    assert main(["batch", str(input_file), str(out), *_engine_args(tiny_model_dir)]) == 0
    assert out.read_bytes() == before
    assert f"0 lines done ({len(records)} already in OUTPUT)" in capsys.readouterr().out


def test_killed_run_resumes_to_the_same_lines(reference, input_file, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "stencil.service.cli", "batch", str(input_file), str(out), "--concurrency", "1",
           *_engine_args(tiny_model_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before 3 lines"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 3 <= written < len(reference[1]), "the kill came after the last line"
    with open(out, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "batch_req_torn", "custom_id": "q5", "resp')
    capsys.readouterr()
    assert main(["batch", str(input_file), str(out), "--concurrency", "1", *_engine_args(tiny_model_dir)]) == 0
    assert f"({written} already in OUTPUT)" in capsys.readouterr().out
    assert _by_id(_read(out)) == _by_id(reference[1])


def test_url_sends_the_lines_to_a_live_server(reference, input_file, tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    with tiny_live_server(tiny_model_dir) as live:
        assert main(["batch", str(input_file), str(out), "--url", live.url, "--concurrency", "4"]) == 0
    assert _by_id(_read(out)) == _by_id(reference[1])


def test_no_answer_is_not_written(input_file, tmp_path, capsys):
    """A server that cannot be reached answers nothing: no line is written, exit 1, and a rerun sends them."""
    out = tmp_path / "out.jsonl"
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["batch", str(input_file), str(out), "--url", f"http://127.0.0.1:{port}", "--concurrency", "2"]) == 1
    codes = Counter(r["error"]["code"] for r in _read(out))
    assert codes == Counter({**Counter(BAD.values()), batch.DUPLICATE: 1})  # only the lines never sent
    assert f"{GOOD} unanswered" in capsys.readouterr().out


def test_plan_resumes_duplicates_and_a_torn_line(tmp_path):
    """The duplicate of a custom_id whose first line is still unanswered is not taken for its answer."""
    out = tmp_path / "out.jsonl"
    dup = batch.output_line("a", error={"code": batch.DUPLICATE, "message": "x"})
    out.write_text(json.dumps(dup) + "\n" + '{"custom_id": "b", "resp')
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": "/generate", "body": {}}) for c in "aab"]
    done, duplicates = batch.recover(out)
    assert out.read_text() == json.dumps(dup) + "\n"
    todo = batch.plan(iter(lines + [lines[0]]), done, duplicates)
    assert [(type(t).__name__, t.custom_id) for t in todo] == [("Request", "a"), ("Request", "b"),
                                                                ("Refused", "a")]
    out.write_text("not a record\n")
    with pytest.raises(batch.BatchFileError, match="line 1"):
        batch.recover(out)
