"""The peers comparison's table (``benchmarks.peers.run``), from synthetic ``bench serve`` reports;
building and running llama-server itself is the script's job, not the test suite's."""

from __future__ import annotations

from pathlib import Path

from benchmarks.peers.run import (choose_api, decode_table, llama_decode_rate, process_group_memory,
                                   stencil_decode_rate, table)

S, L = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _run(stencil_rps: list[float], llama_rps: list[float]) -> dict:
    rows = []
    for c, a, b in zip((1, 8), stencil_rps, llama_rps):
        rows.append({"concurrency": c, "results": {
            S: {"requests_per_s": a, "latency_ms_p50": 1000 * c / a, "valid_fraction": 1.0, "field_accuracy": 0.75,
                "output_tokens_per_s": 30 * a},
            L: {"requests_per_s": b, "latency_ms_p50": 1000 * c / b, "valid_fraction": 0.5,
                "output_tokens_per_s": 20 * b}}})
    return {"throughput": rows}


def test_table_gives_requests_per_second_latency_and_ratio_as_ranges_over_runs():
    text = table([_run([4.0, 8.0], [2.0, 4.0]), _run([5.0, 8.0], [2.0, 5.0])], S, L)
    lines = text.splitlines()
    assert lines[0].startswith("| concurrency | llama-server req/s")
    assert lines[2] == "| 1 | 2.00 (0.50 s) | 4.00-5.00 (0.20-0.25 s) | 2.00-2.50x | 3.00-3.75x | 0.50 / 1.00 | - / 0.75 |"
    assert lines[3] == "| 8 | 4.00-5.00 (1.60-2.00 s) | 8.00 (1.00 s) | 1.60-2.00x | 2.40-3.00x | 0.50 / 1.00 | - / 0.75 |"


def test_decode_rates_count_the_tokens_after_the_first():
    body = {"usage": {"completion_tokens": 11}, "timings": {"ttft_ms": 100.0, "total_ms": 600.0}}
    assert stencil_decode_rate(body) == 10 / 0.5
    assert stencil_decode_rate({"usage": {"completion_tokens": 1}, "timings": body["timings"]}) is None
    assert llama_decode_rate({"timings": {"predicted_n": 64, "predicted_per_second": 81.5}}) == 81.5
    assert llama_decode_rate({"timings": {"predicted_n": 1, "predicted_per_second": 9.0}}) is None


def test_decode_table_gives_medians_and_ratio():
    decode = {k: {"median_tokens_per_s": {"stencil": 90.0, "llama_server": 60.0}, "ratio": 1.5}
              for k in ("free", "json_schema")}
    assert decode_table(decode).splitlines()[2] == "| free | 60.0 | 90.0 | 1.50x |"


def test_process_group_memory_sums_the_group(tmp_path):
    import subprocess
    import sys

    code = "import os, time; b = bytearray(64 * 2**20); os.fork() == 0 and time.sleep(60); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        import time

        for _ in range(200):  # until the child is forked and both hold the touched 64 MiB
            mem = process_group_memory(proc.pid)
            if mem["processes"] == 2 and mem["rss_mb"] > 2 * 60:
                break
            time.sleep(0.05)
        assert mem["processes"] == 2 and mem["rss_mb"] > 2 * 60
        assert mem["leader_peak_rss_mb"] >= 64 * 2**20 / 1e6
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_api_follows_the_chat_template(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import engine.models.gguf_config as gguf_config

    templates = {"chat.gguf": "{{ messages }}", "base.gguf": None}
    monkeypatch.setattr(gguf_config, "read_gguf_info",
                        lambda path: SimpleNamespace(chat_template=templates[Path(path).name]))
    assert choose_api(tmp_path / "chat.gguf", "auto") == "chat"
    assert choose_api(tmp_path / "base.gguf", "auto") == "completions"
    assert choose_api(tmp_path / "base.gguf", "chat") == "chat"


def test_decode_phase_asks_each_server_in_its_dialect(monkeypatch):
    import json

    import httpx

    import benchmarks.peers.run as peers

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/generate":
            n = 9 if "response_schema" in body else 5
            return httpx.Response(200, json={"usage": {"completion_tokens": n},
                                             "timings": {"ttft_ms": 10.0, "total_ms": 10.0 + 100.0 * (n - 1)}})
        return httpx.Response(200, json={"timings": {"predicted_n": 4, "predicted_per_second": 8.0}})

    real = httpx.Client
    monkeypatch.setattr(peers.httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(answer), **kw))
    out = peers.decode_phase("http://s", "http://l", ["p1", "p2"], {"type": "object"}, 16)
    assert out["free"]["median_tokens_per_s"] == {"stencil": 10.0, "llama_server": 8.0}
    assert out["json_schema"]["completion_tokens"] == {"stencil": [9, 9], "llama_server": [4, 4]}
    assert out["free"]["ratio"] == 10.0 / 8.0 and out["stencil_constrained_over_free"] == 1.0
    stencil = [b for path, b in seen if path == "/generate"]
    llama = [b for path, b in seen if path == "/completion"]
    assert len(stencil) == len(llama) == 4 and all(b["speculative"] is False for b in stencil)
    assert [("response_schema" in b) for b in stencil] == [False, False, True, True]
    assert [("json_schema" in b) for b in llama] == [False, False, True, True]
    assert all(b["n_predict"] == 16 and b["cache_prompt"] is False for b in llama)
