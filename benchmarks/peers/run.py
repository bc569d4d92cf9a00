"""Stencil against llama.cpp's ``llama-server`` on the same GGUF, in one run, over HTTP.

``.venv/bin/python -m benchmarks.peers.run [--repeat 2] [--requests 64] [--concurrency 1,8,32] --json out/peers.json``

1. Builds ``llama-server`` from the llama.cpp sources vendored in the ``llama-cpp-python``
   sdist (``benchmarks/peers/build_llama_server.sh``: pip download, cmake, GGML_NATIVE), once,
   under ``~/.cache/stencil/peers``; nothing of llama.cpp enters the repository.
2. Serves the default model's GGUF (``~/.cache/stencil/gguf/SmolLM2-135M-Instruct.Q4_1.gguf``,
   the file Stencil itself loads) with ``llama-server`` on 127.0.0.1 (``--slots`` slots,
   ``--threads`` threads, each slot with room for prompt and answer), and ``stencil serve`` with
   its defaults (plus ``--stencil-args``) on another loopback port.
3. Runs ``stencil bench serve --workload person`` against both in one go (the person-extraction
   chats of the issue: about 40 prompt tokens, name/age/city, ``response_format: json_schema``,
   greedy, ``max_tokens`` 64, streamed), ``--repeat`` times.
4. Writes the JSON report (every repetition's ``bench serve`` report, the commands, the
   machine's load average before and after) and prints the table: requests/s and p50 latency
   per concurrency for each server, the ratio, valid fractions.

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
    p.add_argument("--repeat", type=int, default=2, help="runs of bench serve (each against both servers)")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF for llama-server (default: the one the default model was converted from)")
    p.add_argument("--slots", type=int, default=32, help="llama-server --parallel")
    p.add_argument("--threads", type=int, default=None, help="llama-server --threads (default: the CPU count)")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server context per slot (tokens)")
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
    as a range over the repetitions) and the ratio of Stencil's requests/s to llama-server's."""
    levels = [row["concurrency"] for row in reports[0]["throughput"]]
    lines = ["| concurrency | llama-server req/s (p50 latency) | Stencil req/s (p50) | Stencil / llama-server | "
             "valid (llama-server / Stencil) |", "|---|---|---|---|---|"]

    def span(values: list[float], fmt: str) -> str:
        lo, hi = min(values), max(values)
        return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"

    for i, c in enumerate(levels):
        rows = [r["throughput"][i]["results"] for r in reports]
        cell = {}
        for name, url in (("llama", llama), ("stencil", stencil)):
            rps = [row[url]["requests_per_s"] for row in rows]
            lat = [row[url]["latency_ms_p50"] / 1e3 for row in rows]
            cell[name] = f"{span(rps, '.2f')} ({span(lat, '.2f')} s)"
            cell[name + "_valid"] = span([row[url]["valid_fraction"] for row in rows], ".2f")
        ratios = [row[stencil]["requests_per_s"] / row[llama]["requests_per_s"] for row in rows]
        lines.append(f"| {c} | {cell['llama']} | {cell['stencil']} | {span(ratios, '.2f')}x | "
                     f"{cell['llama_valid']} / {cell['stencil_valid']} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from engine.models.default_model import ensure_default_model

    gguf = args.gguf
    if gguf is None:
        ensure_default_model()
        cache = Path(os.environ.get("STENCIL_CACHE_DIR", Path.home() / ".cache" / "stencil"))
        gguf = cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    binary = args.llama_server or build_llama_server()
    threads = args.threads or os.cpu_count() or 1
    lport, sport = _free_port(), _free_port()
    llama_cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(lport),
                 "--parallel", str(args.slots), "--threads", str(threads),
                 "--ctx-size", str(args.slots * args.ctx_per_slot), "--no-webui", "--alias", "smollm2"]
    stencil_cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(sport),
                   "--log-level", "warning", *shlex.split(args.stencil_args)]
    logs = args.json.parent / (args.json.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    llama = stencil = None
    llama_url, stencil_url = f"http://127.0.0.1:{lport}", f"http://127.0.0.1:{sport}"
    report: dict = {"llama_server": llama_cmd, "stencil": stencil_cmd, "gguf": str(gguf),
                    "load_before": os.getloadavg(), "runs": []}
    try:
        with open(logs / "llama-server.log", "w") as lf, open(logs / "stencil.log", "w") as sf:
            llama = subprocess.Popen(llama_cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            stencil = subprocess.Popen(stencil_cmd, stdout=sf, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            _wait_healthy(llama_url + "/health", llama, "llama-server")
            _wait_healthy(stencil_url + "/health", stencil, "stencil serve")
            for k in range(args.repeat):
                out = args.json.parent / f"{args.json.stem}-serve-{k + 1}.json"
                cmd = [sys.executable, "-m", "service.cli", "bench", "serve", "--workload", "person",
                       "--base-url", stencil_url, "--base-url", llama_url, "--requests", str(args.requests),
                       "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--json", str(out)]
                print(f"[peers] run {k + 1}/{args.repeat}: {shlex.join(cmd)}", flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT)
                report["runs"].append(json.loads(out.read_text()))
    finally:
        _stop(stencil)
        _stop(llama)
    report["load_after"] = os.getloadavg()
    report["table"] = table(report["runs"], stencil_url, llama_url)
    args.json.write_text(json.dumps(report, indent=2))
    print(report["table"])
    print(f"load average before {report['load_before']}, after {report['load_after']}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
