"""The peers comparison's table (``stencil.benchmarks.peers.run``), from synthetic ``bench serve`` reports;
building and running llama-server itself is the script's job, not the test suite's."""

from __future__ import annotations

from pathlib import Path

from stencil.benchmarks.peers.run import (choose_api, decode_table, llama_decode_rate, process_group_memory,
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

    import stencil.engine.models.gguf_config as gguf_config

    templates = {"chat.gguf": "{{ messages }}", "base.gguf": None}
    monkeypatch.setattr(gguf_config, "read_gguf_info",
                        lambda path: SimpleNamespace(chat_template=templates[Path(path).name]))
    assert choose_api(tmp_path / "chat.gguf", "auto") == "chat"
    assert choose_api(tmp_path / "base.gguf", "auto") == "completions"
    assert choose_api(tmp_path / "base.gguf", "chat") == "chat"


def test_decode_phase_asks_each_server_in_its_dialect(monkeypatch):
    import json

    import httpx

    import stencil.benchmarks.peers.run as peers

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


def test_build_script_takes_this_cpus_flags_with_amx_off():
    import subprocess

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "build_llama_server.sh"
    got = subprocess.run(["bash", str(script), "--options"], capture_output=True, text=True, check=True)
    options = dict(line.removeprefix("-D").split("=") for line in got.stdout.split())
    assert options["GGML_NATIVE"] == "OFF"
    assert options["GGML_AMX_TILE"] == options["GGML_AMX_INT8"] == options["GGML_AMX_BF16"] == "OFF"
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
    assert options["GGML_AVX2"] == ("ON" if "avx2" in flags else "OFF")
    assert options["GGML_AVX512"] == ("ON" if "avx512f" in flags else "OFF")
    assert options["GGML_AVX512_VNNI"] == ("ON" if "avx512_vnni" in flags else "OFF")
    native = subprocess.run(["bash", str(script), "--options"], capture_output=True, text=True, check=True,
                            env={**__import__("os").environ, "LLAMA_BUILD": "native"})
    assert native.stdout.split() == ["-DGGML_NATIVE=ON"]
    bad = subprocess.run(["bash", str(script), "--options"], capture_output=True, text=True,
                         env={**__import__("os").environ, "LLAMA_BUILD": "fast"})
    assert bad.returncode == 2 and "LLAMA_BUILD" in bad.stderr


def test_build_info_names_the_build_and_whether_amx_ran(tmp_path):
    from stencil.benchmarks.peers.run import llama_build_info

    binary = tmp_path / "llama-server"
    (tmp_path / "BUILD_INFO").write_text("llama-cpp-python 0.3.36\nbuild explicit\n-DGGML_NATIVE=OFF\n"
                                         "-DGGML_AMX_INT8=OFF\n")
    log = "main: loading\nsystem_info: n_threads = 2 / 2 | CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 0 |\n"
    got = llama_build_info(binary, log)
    assert got["llama_cpp_build"][:3] == ["llama-cpp-python 0.3.36", "build explicit", "-DGGML_NATIVE=OFF"]
    assert got["llama_cpp_system_info"].startswith("system_info: n_threads = 2") and got["llama_cpp_amx"] is False
    assert llama_build_info(binary, log.replace("AMX_INT8 = 0", "AMX_INT8 = 1"))["llama_cpp_amx"] is True
    # a silent log: the build says; a native build runs AMX exactly where the CPU has it
    assert llama_build_info(binary, "", cpu_flags={"amx_int8"})["llama_cpp_amx"] is False
    (tmp_path / "BUILD_INFO").write_text("llama-cpp-python 0.3.36\nbuild native\n-DGGML_NATIVE=ON\n")
    assert llama_build_info(binary, "", cpu_flags={"avx512f", "amx_int8"})["llama_cpp_amx"] is True
    assert llama_build_info(binary, "", cpu_flags={"avx512f"})["llama_cpp_amx"] is False
    unknown = llama_build_info(tmp_path / "elsewhere" / "llama-server", "")
    assert unknown["llama_cpp_build"] is None and unknown["llama_cpp_amx"] is None


def test_prompt_documents_are_windows_of_the_tokens_distinct_from_their_first_block():
    from stencil.benchmarks.peers.run import prompt_documents

    # a stand-in tokenizer: one token a word
    docs = prompt_documents(12, 1000, lambda text: text.split(), lambda ids: " ".join(ids))
    assert len(set(docs)) == 12
    # no two share their first 16 words (a 16-token KV block at least); each is the window and its heading
    assert len({tuple(d.split()[:16]) for d in docs}) == 12
    assert all(len(d.split()) == 984 + 8 for d in docs)  # "Document i of 12, for a summary." "Summary:"


def test_prompt_phase_counts_each_servers_prompt_tokens(monkeypatch):
    import json
    import threading

    import httpx

    import stencil.benchmarks.peers.run as peers

    seen = []
    lock = threading.Lock()

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with lock:
            seen.append((request.url.path, body))
        if request.url.path == "/generate":
            return httpx.Response(200, json={"usage": {"prompt_tokens": 100, "completion_tokens": 1}})
        return httpx.Response(200, json={"tokens_evaluated": 101, "timings": {"prompt_n": 101}})

    real = httpx.Client
    monkeypatch.setattr(peers.httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(answer), **kw))
    out = peers.prompt_phase("http://s", "http://l", ["d1", "d2", "d3", "d4", "d5", "d6"], [1, 2])
    assert [row["concurrency"] for row in out["levels"]] == [1, 2]
    for row in out["levels"]:
        assert row["stencil"]["prompt_tokens"] == 300 and row["llama_server"]["prompt_tokens"] == 303
        assert row["ratio"] == (row["stencil"]["prompt_tokens_per_s"] / row["llama_server"]["prompt_tokens_per_s"])
    stencil = [b for path, b in seen if path == "/generate"]
    llama = [b for path, b in seen if path == "/completion"]
    assert len(stencil) == len(llama) == 6
    # each level reads documents of its own: none is a prefix-cache hit left by an earlier level
    assert sorted(b["prompt"] for b in stencil) == ["d1", "d2", "d3", "d4", "d5", "d6"]
    assert all(b["max_tokens"] == 1 and b["speculative"] is False for b in stencil)
    assert all(b["n_predict"] == 1 and b["cache_prompt"] is False for b in llama)
    table = peers.prompt_table(out).splitlines()
    assert table[0].startswith("| prompt phase (3 documents)") and table[2].startswith("| c=1 |")
