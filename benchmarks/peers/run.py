"""Stencil against llama.cpp's ``llama-server`` on the same GGUF, in one run, over HTTP.

``stencil bench peers [--model FILE.gguf] [--repeat 2] [--requests 64] [--concurrency 1,8,32] --json out/peers.json``
(also ``.venv/bin/python -m stencil.benchmarks.peers.run ...``)

1. Builds ``llama-server`` from the llama.cpp sources vendored in the ``llama-cpp-python``
   sdist (``benchmarks/peers/build_llama_server.sh``: pip download, cmake with the x86 options
   this CPU's flags allow and AMX off, since the native build segfaults on AMX Xeons), once,
   under ``~/.cache/stencil/peers``; nothing of llama.cpp enters the repository. The report names
   the build (``llama_cpp_build``: its BUILD_INFO) and what the running server says of itself
   (``llama_cpp_system_info``, ``llama_cpp_amx``: whether it used AMX tiles).
2. Serves ``--model`` (default: the default model's GGUF,
   ``~/.cache/stencil/gguf/SmolLM2-135M-Instruct.Q4_1.gguf``) with ``llama-server`` on 127.0.0.1
   (``--slots`` slots, ``--threads`` threads, ``--ctx-per-slot`` tokens each: ``-c`` is their
   product) and ``stencil serve --model`` the same file on another loopback port, with the same
   KV capacity in tokens (``--num-kv-blocks``, 16 tokens a block), as many requests running at
   once as llama-server has slots (``--max-num-seqs``: it also sizes a hybrid model's window
   pool, as ``--parallel`` sizes llama.cpp's SWA cache) and otherwise its defaults (plus
   ``--stencil-args``).
3. Runs ``stencil bench serve --workload person`` against both in one go (the person-extraction
   items: a one-sentence text, name/age/city, JSON Schema, greedy, ``max_tokens`` 64, streamed),
   ``--repeat`` times: as chats when the file has a chat template, else (a base model such as
   Gemma 3 270M) as ``/v1/completions`` text prompts (``--api`` overrides). Each answer is
   checked against the schema (valid) and scored field by field against the planted facts.
4. **Plain decode at one request** (``--decode-requests``, 0 skips it): the same prompts as raw
   text, one at a time, free and with the JSON Schema, Stencil's speculation off (the request's
   ``speculative: false``): llama-server's ``/completion`` reports ``timings.predicted_per_second``;
   for Stencil's ``/generate`` the rate is ``(completion_tokens - 1) / (total_ms - ttft_ms)``
   (tokens after the first over the time after it). Medians per server and their ratio.
5. **Prompt phase** (``--prompt-requests``, 0 skips it): documents of about ``--prompt-tokens``
   tokens (windows of README.md's tokens, cut and read back by llama-server's own tokenizer;
   distinct from their first block, so no prefix cache serves them; llama-server's
   ``cache_prompt`` off), each asking one output token, at ``--prompt-concurrency`` (1 and 8):
   prompt tokens/s = the prompt tokens each server counted over the wall time of the level, and
   the median time per request. Prefill is where a GEMM kernel shows first.
6. **Resident memory** of both servers after the runs: the RSS summed over each server's process
   group (Stencil's grammar-compile workers included) and the main process's peak (``VmHWM``).
7. Writes the JSON report (every repetition's ``bench serve`` report, the decode samples, the
   memory, the commands, the machine's load average before and after) and prints the tables.

Both servers stay up for the whole run and are stopped at the end (also on errors and Ctrl-C).
Timings are only comparable within one run, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--repeat", type=int, default=2,
                   help="runs of bench serve (each against both servers); 0: only decode and memory")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,8,32", help="concurrency levels of bench serve (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every answer (default: %(default)s)")
    p.add_argument("--model", "--gguf", dest="model", type=Path, default=None,
                   help="the GGUF both servers load (default: the one the default model was converted from)")
    p.add_argument("--api", choices=("auto", "chat", "completions"), default="auto",
                   help="auto: chat when the GGUF has a chat template, else completions")
    p.add_argument("--decode-requests", type=int, default=8,
                   help="requests per server and kind (free, json_schema) of the plain-decode phase; 0 skips it")
    p.add_argument("--prompt-requests", type=int, default=8,
                   help="documents per concurrency level of the prompt phase (each level its own, each sent "
                        "to both servers); 0 skips it")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="about how long each document is (tokens)")
    p.add_argument("--prompt-concurrency", default="1,8", help="concurrency levels of the prompt phase")
    p.add_argument("--slots", type=int, default=32, help="llama-server --parallel")
    p.add_argument("--threads", type=int, default=None, help="llama-server --threads (default: the CPU count)")
    p.add_argument("--ctx-per-slot", type=int, default=1280,
                   help="llama-server context per slot (tokens; a prompt-phase document must fit in one)")
    p.add_argument("--stencil-args", default="", help="more options of stencil serve, in one string")
    p.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: build one)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} was not healthy within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def build_llama_server() -> Path:
    """Path of a built ``llama-server`` (built on first use; see ``build_llama_server.sh``)."""
    out = subprocess.run(["bash", str(HERE / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PIP": f"{sys.executable} -m pip"})
    return Path(out.stdout.strip().splitlines()[-1])


def table(reports: list[dict], stencil: str, llama: str) -> str:
    """The markdown table of the issue: per concurrency, both servers' requests/s (p50 latency,
    as a range over the repetitions), the ratio of Stencil's requests/s to llama-server's and of
    their output tokens/s, the valid fractions and the field accuracies (where the items have
    known answers)."""
    levels = [row["concurrency"] for row in reports[0]["throughput"]]
    lines = ["| concurrency | llama-server req/s (p50 latency) | Stencil req/s (p50) | Stencil / llama-server | "
             "output tok/s ratio | valid (llama-server / Stencil) | field accuracy (llama-server / Stencil) |",
             "|---|---|---|---|---|---|---|"]

    for i, c in enumerate(levels):
        rows = [r["throughput"][i]["results"] for r in reports]
        cell = {}
        for name, url in (("llama", llama), ("stencil", stencil)):
            rps = [row[url]["requests_per_s"] for row in rows]
            lat = [row[url]["latency_ms_p50"] / 1e3 for row in rows]
            cell[name] = f"{span(rps, '.2f')} ({span(lat, '.2f')} s)"
            cell[name + "_valid"] = span([row[url]["valid_fraction"] for row in rows], ".2f")
            acc = [row[url].get("field_accuracy") for row in rows]
            cell[name + "_fields"] = "-" if None in acc else span(acc, ".2f")
        ratios = [row[stencil]["requests_per_s"] / row[llama]["requests_per_s"] for row in rows]
        tok = [row[stencil].get("output_tokens_per_s") or 0.0 for row in rows]
        tok_ratio = ("-" if not all(row[llama].get("output_tokens_per_s") for row in rows) else
                     span([t / row[llama]["output_tokens_per_s"] for t, row in zip(tok, rows)], ".2f") + "x")
        lines.append(f"| {c} | {cell['llama']} | {cell['stencil']} | {span(ratios, '.2f')}x | {tok_ratio} | "
                     f"{cell['llama_valid']} / {cell['stencil_valid']} | "
                     f"{cell['llama_fields']} / {cell['stencil_fields']} |")
    return "\n".join(lines)


def span(values: list[float], fmt: str) -> str:
    """``lo-hi`` of ``values`` in ``fmt``, or one number where both print the same."""
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


# -- plain decode at one request -------------------------------------------------------------------

def stencil_decode_rate(body: dict) -> float | None:
    """Decode tokens/s of one ``/generate`` answer: the tokens after the first over the time after
    the first (``timings.total_ms - timings.ttft_ms``); None for fewer than 2 tokens."""
    n = body["usage"]["completion_tokens"]
    t = body["timings"]
    if n < 2 or t.get("ttft_ms") is None or t["total_ms"] <= t["ttft_ms"]:
        return None
    return (n - 1) / ((t["total_ms"] - t["ttft_ms"]) / 1e3)


def llama_decode_rate(body: dict) -> float | None:
    """Decode tokens/s of one llama-server ``/completion`` answer: its own
    ``timings.predicted_per_second`` (None for fewer than 2 tokens)."""
    t = body.get("timings") or {}
    return t.get("predicted_per_second") if t.get("predicted_n", 0) >= 2 else None


def decode_phase(stencil_url: str, llama_url: str, prompts: list[str], schema: dict, max_tokens: int) -> dict:
    """One request at a time, alternating the servers: per kind (``free``, ``json_schema``) the
    decode tokens/s of each answer, their medians and Stencil's median over llama-server's."""
    import statistics

    def stencil_body(prompt: str, constrained: bool) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculative": False}
        return {**body, "response_schema": schema} if constrained else body

    def llama_body(prompt: str, constrained: bool) -> dict:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
        return {**body, "json_schema": schema} if constrained else body

    # per server: URL, request body, tokens of the answer, decode rate of the answer
    servers = {"stencil": (stencil_url + "/generate", stencil_body,
                           lambda got: got["usage"]["completion_tokens"], stencil_decode_rate),
               "llama_server": (llama_url + "/completion", llama_body,
                                lambda got: int((got.get("timings") or {}).get("predicted_n", 0)), llama_decode_rate)}
    out: dict = {}
    with httpx.Client(timeout=600) as http:
        for kind in ("free", "json_schema"):
            rates: dict[str, list[float]] = {name: [] for name in servers}
            tokens: dict[str, list[int]] = {name: [] for name in servers}
            for prompt in prompts:
                for name, (url, make_body, count, rate_of) in servers.items():
                    r = http.post(url, json=make_body(prompt, kind == "json_schema"))
                    r.raise_for_status()
                    got = r.json()
                    tokens[name].append(count(got))
                    if (rate := rate_of(got)) is not None:
                        rates[name].append(rate)
            med = {k: statistics.median(v) if v else None for k, v in rates.items()}
            out[kind] = {"tokens_per_s": rates, "completion_tokens": tokens,
                         "median_tokens_per_s": med,
                         "ratio": med["stencil"] / med["llama_server"] if med["stencil"] and med["llama_server"]
                         else None}
    for name in ("stencil", "llama_server"):
        free, constrained = (out[k]["median_tokens_per_s"][name] for k in ("free", "json_schema"))
        out[f"{name}_constrained_over_free"] = constrained / free if free and constrained else None
    return out


def decode_table(decode: dict) -> str:
    """Markdown: per kind, both servers' median decode tokens/s at one request and the ratio."""
    lines = ["| decode at c=1 (speculation off) | llama-server tok/s | Stencil tok/s | Stencil / llama-server |",
             "|---|---|---|---|"]
    for kind in ("free", "json_schema"):
        med = decode[kind]["median_tokens_per_s"]
        ratio = decode[kind]["ratio"]
        lines.append(f"| {kind} | {med['llama_server'] or 0:.1f} | {med['stencil'] or 0:.1f} | "
                     f"{ratio or 0:.2f}x |")
    return "\n".join(lines)


# -- prompt phase ----------------------------------------------------------------------------------

def prompt_documents(n: int, tokens: int, tokenize, detokenize, source: Path = ROOT / "README.md") -> list[str]:
    """``n`` distinct documents of about ``tokens`` tokens each: windows of ``source``'s tokens at
    different offsets (``tokenize(text) -> ids``, ``detokenize(ids) -> text``: the served model's
    own tokenizer), each opening with its own number so that no two share a first KV block (no
    prefix cache hit on either server)."""
    ids = tokenize(source.read_text())
    body = max(1, tokens - 16)  # the heading's and the closing words' tokens
    out = []
    for i in range(n):
        start = (i * 997) % max(1, len(ids) - body)
        text = detokenize(ids[start:start + body])
        out.append(f"Document {i + 1} of {n}, for a summary.\n\n{text}\n\nSummary:")
    return out


def llama_tokenizer(url: str):
    """``(tokenize, detokenize)`` through llama-server's ``/tokenize`` and ``/detokenize``."""
    def tokenize(text: str) -> list[int]:
        r = httpx.post(url + "/tokenize", json={"content": text}, timeout=120)
        r.raise_for_status()
        return r.json()["tokens"]

    def detokenize(ids: list[int]) -> str:
        r = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=120)
        r.raise_for_status()
        return r.json()["content"]

    return tokenize, detokenize


def prompt_phase(stencil_url: str, llama_url: str, documents: list[str], levels: list[int]) -> dict:
    """Per level ``c``: its own share of ``documents`` (a document read at an earlier level would
    be a prefix-cache hit for Stencil, whose cache stays on), to one server ``c`` at a time (one
    output token each; llama-server's prompt cache off), then to the other; prompt tokens/s (the
    prompt tokens the server counted over the level's wall time), the median seconds per request,
    and Stencil's rate over llama-server's."""
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    def stencil_call(http: httpx.Client, doc: str) -> int:
        r = http.post(stencil_url + "/generate", json={"prompt": doc, "max_tokens": 1, "temperature": 0,
                                                       "speculative": False})
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])

    def llama_call(http: httpx.Client, doc: str) -> int:
        r = http.post(llama_url + "/completion", json={"prompt": doc, "n_predict": 1, "temperature": 0,
                                                       "cache_prompt": False})
        r.raise_for_status()
        got = r.json()
        return int(got.get("tokens_evaluated") or (got.get("timings") or {}).get("prompt_n", 0))

    per_level = len(documents) // len(levels)
    out: dict = {"documents": per_level, "levels": []}
    with httpx.Client(timeout=1800, limits=httpx.Limits(max_connections=64)) as http:
        for i, c in enumerate(levels):
            share = documents[i * per_level:(i + 1) * per_level]
            row: dict = {"concurrency": c}
            for name, call in (("llama_server", llama_call), ("stencil", stencil_call)):
                times: list[float] = []

                def one(doc: str) -> int:
                    t0 = time.perf_counter()
                    n = call(http, doc)
                    times.append(time.perf_counter() - t0)
                    return n

                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    counted = list(pool.map(one, share))
                wall = time.perf_counter() - t0
                row[name] = {"prompt_tokens": sum(counted), "wall_s": wall,
                             "prompt_tokens_per_s": sum(counted) / wall,
                             "request_s_p50": statistics.median(times)}
            row["ratio"] = row["stencil"]["prompt_tokens_per_s"] / row["llama_server"]["prompt_tokens_per_s"]
            out["levels"].append(row)
    return out


def prompt_table(prompt: dict) -> str:
    """Markdown: per concurrency, both servers' prompt tokens/s (median seconds a request) and the ratio."""
    lines = [f"| prompt phase ({prompt['documents']} documents) | llama-server prompt tok/s (p50 s) | "
             "Stencil prompt tok/s (p50 s) | Stencil / llama-server |", "|---|---|---|---|"]
    for row in prompt["levels"]:
        cells = [f"{row[k]['prompt_tokens_per_s']:.1f} ({row[k]['request_s_p50']:.2f} s)"
                 for k in ("llama_server", "stencil")]
        lines.append(f"| c={row['concurrency']} | {cells[0]} | {cells[1]} | {row['ratio']:.2f}x |")
    return "\n".join(lines)


# -- which llama.cpp ran ---------------------------------------------------------------------------

def llama_build_info(binary: Path, log_text: str, cpu_flags: set[str] | None = None) -> dict:
    """What is known of the llama-server that ran: ``llama_cpp_build`` (the BUILD_INFO lines the
    build script wrote beside the binary: version, ``explicit`` or ``native``, the cmake options;
    None for a binary built elsewhere), ``llama_cpp_system_info`` (the server's own
    ``system_info`` log line, where its verbosity printed one) and ``llama_cpp_amx``: whether it
    ran AMX tiles. That is read from the log where it says (``AMX_INT8 = 1``, an AMX weight
    buffer), else from the build: ggml's AMX kernels are compiled in by ``-DGGML_AMX_INT8=ON``, or
    by a native build on a CPU with ``amx_int8`` (``cpu_flags``: /proc/cpuinfo's, by default), and
    then take every matrix they support; None for an unknown binary with a silent log."""
    info_file = binary.parent / "BUILD_INFO"
    build = [x for x in info_file.read_text().split("\n") if x] if info_file.is_file() else None
    system = next((line.strip() for line in log_text.splitlines() if "system_info:" in line), None)
    if system is not None or "AMX model buffer" in log_text:
        amx: bool | None = bool(system and "AMX_INT8 = 1" in system) or "AMX model buffer" in log_text
    elif build is not None:
        flags = cpu_flags if cpu_flags is not None else _cpu_flags()
        amx = "-DGGML_AMX_INT8=ON" in build or ("build native" in build and "amx_int8" in flags)
    else:
        amx = None
    return {"llama_cpp_build": build, "llama_cpp_system_info": system, "llama_cpp_amx": amx}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


# -- resident memory -------------------------------------------------------------------------------

def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def process_group_memory(pgid: int) -> dict:
    """Resident memory of a process group (a server started with ``start_new_session``): the RSS
    summed over its live members and the leader's peak RSS, in MB (10^6 bytes); Linux ``/proc``."""
    total = 0
    members = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            total += _status_kib(int(entry), "VmRSS")
            members += 1
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    peak = _status_kib(pgid, "VmHWM")
    return {"rss_mb": total * 1024 / 1e6, "leader_peak_rss_mb": peak * 1024 / 1e6, "processes": members}


# -- the run ---------------------------------------------------------------------------------------

def default_gguf() -> Path:
    """The GGUF the default model is converted from (fetched on first use)."""
    from stencil.engine.models.default_model import ensure_default_model

    ensure_default_model()
    cache = Path(os.environ.get("STENCIL_CACHE_DIR", Path.home() / ".cache" / "stencil"))
    return cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def choose_api(gguf: Path, api: str) -> str:
    """``chat`` or ``completions``: ``api`` unless ``auto``, then chat exactly when the file has
    a chat template (``tokenizer.chat_template``)."""
    if api != "auto":
        return api
    from stencil.engine.models.gguf_config import read_gguf_info

    return "chat" if read_gguf_info(gguf).chat_template else "completions"


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.serve import workload_jobs

    gguf = (args.model or default_gguf()).resolve()
    if gguf.is_dir():
        found = sorted(gguf.glob("*.gguf"))
        if len(found) != 1:
            print(f"stencil bench peers: {gguf} holds {len(found)} .gguf files; name one", file=sys.stderr)
            return 2
        gguf = found[0]
    api = choose_api(gguf, args.api)
    binary = args.llama_server or build_llama_server()
    threads = args.threads or os.cpu_count() or 1
    lport, sport = _free_port(), _free_port()
    kv_tokens = args.slots * args.ctx_per_slot
    llama_cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(lport),
                 "--parallel", str(args.slots), "--threads", str(threads),
                 "--ctx-size", str(kv_tokens), "--no-webui", "--alias", gguf.stem]
    stencil_cmd = [sys.executable, "-m", "stencil.service.cli", "serve", "--model", str(gguf),
                   "--host", "127.0.0.1", "--port", str(sport), "--log-level", "warning",
                   "--num-kv-blocks", str(-(-kv_tokens // 16)), "--max-num-seqs", str(args.slots),
                   *shlex.split(args.stencil_args)]
    logs = args.json.parent / (args.json.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    llama = stencil = None
    llama_url, stencil_url = f"http://127.0.0.1:{lport}", f"http://127.0.0.1:{sport}"
    report: dict = {"llama_server": llama_cmd, "stencil": stencil_cmd, "gguf": str(gguf), "api": api,
                    "kv_cache_tokens": kv_tokens, "cpu": cpu_model(), "load_before": os.getloadavg(), "runs": []}
    try:
        with open(logs / "llama-server.log", "w") as lf, open(logs / "stencil.log", "w") as sf:
            llama = subprocess.Popen(llama_cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            stencil = subprocess.Popen(stencil_cmd, stdout=sf, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            _wait_healthy(llama_url + "/health", llama, "llama-server")
            _wait_healthy(stencil_url + "/health", stencil, "stencil serve")
            for k in range(args.repeat):
                out = args.json.parent / f"{args.json.stem}-serve-{k + 1}.json"
                cmd = [sys.executable, "-m", "stencil.service.cli", "bench", "serve", "--workload", "person", "--api", api,
                       "--base-url", stencil_url, "--base-url", llama_url, "--requests", str(args.requests),
                       "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--json", str(out)]
                print(f"[peers] run {k + 1}/{args.repeat}: {shlex.join(cmd)}", flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
                report["runs"].append(json.loads(out.read_text()))
            if args.decode_requests > 0:
                jobs, _ = workload_jobs("person", args.decode_requests)
                print(f"[peers] plain decode at one request, {args.decode_requests} prompts per kind", flush=True)
                report["decode"] = decode_phase(stencil_url, llama_url, [j.prompt for j in jobs], jobs[0].schema,
                                                args.max_tokens)
            if args.prompt_requests > 0:
                levels = [int(c) for c in args.prompt_concurrency.split(",")]
                docs = prompt_documents(args.prompt_requests * len(levels), args.prompt_tokens,
                                        *llama_tokenizer(llama_url))
                print(f"[peers] prompt phase: {len(docs)} documents of ~{args.prompt_tokens} tokens at c={levels}",
                      flush=True)
                report["prompt"] = prompt_phase(stencil_url, llama_url, docs, levels)
            report["memory"] = {"stencil": process_group_memory(stencil.pid),
                                "llama_server": process_group_memory(llama.pid)}
    finally:
        _stop(stencil)
        _stop(llama)
    report["load_after"] = os.getloadavg()
    report.update(llama_build_info(Path(binary), (logs / "llama-server.log").read_text(errors="replace")))
    mem = report["memory"]
    report["memory"]["stencil_over_llama_server"] = mem["stencil"]["rss_mb"] / mem["llama_server"]["rss_mb"]
    if report["runs"]:
        report["table"] = table(report["runs"], stencil_url, llama_url)
    if "decode" in report:
        report["decode_table"] = decode_table(report["decode"])
    if "prompt" in report:
        report["prompt_table"] = prompt_table(report["prompt"])
    args.json.write_text(json.dumps(report, indent=2))
    print(f"{gguf.name} ({api}), {report['cpu']}")
    build = report["llama_cpp_build"]
    amx = {True: "with AMX", False: "without AMX", None: "AMX unknown"}[report["llama_cpp_amx"]]
    print(f"llama-server: {' '.join(build[:2]) if build else binary} ({amx})")
    if "table" in report:
        print(report["table"])
    if "decode" in report:
        print(report["decode_table"])
    if "prompt" in report:
        print(report["prompt_table"])
    print(f"resident memory (process groups, KV for {kv_tokens} tokens): Stencil {mem['stencil']['rss_mb']:.0f} MB, "
          f"llama-server {mem['llama_server']['rss_mb']:.0f} MB ({mem['stencil_over_llama_server']:.2f}x)")
    print(f"load average before {report['load_before']}, after {report['load_after']}; wrote {args.json}")
    return 0


def cpu_model() -> str:
    """``lscpu``'s model name (the CPU a figure holds for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
