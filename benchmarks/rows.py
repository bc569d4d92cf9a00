"""``stencil bench rows``: one row of activations through one quantized matrix, Stencil's block
kernel against llama.cpp's, per GGUF type, in one run: the weight bytes each streams per second.

A decode step at one request is a row times every matrix of the model: it runs at the speed the
weights arrive. llama.cpp's side is its own kernel benchmark, ``test-backend-ops perf`` (built
from the llama-cpp-python sdist by ``benchmarks/peers/build_llama_server.sh --test-backend-ops``),
on its own matrix shape for this measurement, ``MUL_MAT(type_a=T, type_b=f32, m=4096, n=1,
k=14336)`` (a 4096 x 14336 weight: 33 MB in Q4_K, past this machine's L3 so it streams from
DRAM); its time per run includes quantizing the row to its int8 blocks, as Stencil's does.
Stencil's side is ``stencil.kernels.ggml_blocks`` on random valid blocks of the same type and shape, the
row quantized with ``--activation-precision``'s terms. ``test-backend-ops`` gives its CPU
backend ``hardware_concurrency / 2`` threads (1 on a 2-core machine) and takes no option for it,
so Stencil is timed with that many threads too (``--threads``, default the same rule), plus,
where different, at ``--all-threads`` (the CPU count) for reference.

GB/s = weight bytes / time per run (median of Stencil's ``--repeats`` calls; llama.cpp's mean
over its own runs), the two alternated ``--rounds`` times per type and each side's median round
reported. ``ratio`` = Stencil's GB/s over llama.cpp's.

    stencil bench rows --json out/rows.json [--types Q4_K,Q5_K,Q6_K,Q8_0,Q5_0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
M, K = 4096, 14336  # test-backend-ops' perf shape for MUL_MAT at n = 1 (out features, in features)
_RUN = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=1,k=(\d+),.*?\s(\d+) runs -\s+([\d.]+) us/run")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q5_0,Q4_0,Q4_1",
                   help="GGUF types (comma-separated; default: %(default)s)")
    p.add_argument("--repeats", type=int, default=60,
                   help="Stencil's timed calls per type and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternations of the two kernels per type (the medians are reported, each round listed; "
                        "default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="Stencil's threads for the comparison (default: test-backend-ops' own, CPU count / 2)")
    p.add_argument("--activation-precision", choices=("exact", "int8"), default="exact",
                   help="Stencil's activations: exact (two int8 terms) or int8 (llama.cpp's one; default: %(default)s)")
    p.add_argument("--test-backend-ops", type=Path, default=None, help="a test-backend-ops binary (default: build one)")


def build_test_backend_ops() -> Path:
    out = subprocess.run(["bash", str(HERE / "peers" / "build_llama_server.sh"), "--test-backend-ops"], check=True,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PIP": f"{sys.executable} -m pip"})
    return Path(out.stdout.strip().splitlines()[-1])


def parse_runs(text: str) -> dict[str, float]:
    """``{GGUF type: microseconds a run}`` from ``test-backend-ops perf -o MUL_MAT`` output, for
    its one-row cases (``n=1``) of shape ``M x K``."""
    out = {}
    for t, m, k, _runs, us in _RUN.findall(text):
        if (int(m), int(k)) == (M, K):
            out[t.upper()] = float(us)
    return out


def ggml_name(qtype: str) -> str:
    """ggml's own spelling of a type (``Q4_K`` -> ``q4_K``, ``Q8_0`` -> ``q8_0``)."""
    return qtype[0].lower() + qtype[1:]


def llama_cpp_us(binary: Path, qtype: str) -> float | None:
    """llama.cpp's microseconds per one-row run on ``qtype`` (None where it has no such case)."""
    pattern = f"type_a={ggml_name(qtype)},type_b=f32,m={M},n=1,k={K},"
    got = subprocess.run([str(binary), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", re.escape(pattern)],
                         capture_output=True, text=True, timeout=600)
    return parse_runs(got.stdout).get(qtype)


def stencil_us(qtype: str, threads: int, repeats: int, terms: int) -> float:
    """Stencil's median microseconds for quantizing one row and multiplying it through a random
    ``M x K`` matrix of ``qtype`` blocks."""
    import torch

    from stencil.benchmarks.cpu_kernels import _median_ms, _random_blocks
    from stencil.kernels import ggml_blocks

    g = torch.Generator().manual_seed(0)
    raw = _random_blocks(qtype, M, K, g)
    x = torch.randn(1, K, generator=g)
    group = ggml_blocks.BLOCKS[qtype][1]
    out = torch.empty(1, M)

    def call():
        ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, group, threads=threads, terms=terms), out=out,
                         threads=threads)

    return _median_ms(call, repeats) * 1e3


def weight_bytes(qtype: str) -> int:
    from stencil.kernels import ggml_blocks

    return M * ggml_blocks.row_bytes(qtype, K)


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.peers.run import cpu_model
    from stencil.engine.config import ACTIVATION_PRECISIONS
    from stencil.kernels import ggml_blocks

    if not ggml_blocks.available():
        print(f"stencil bench rows: the block kernel is unavailable here ({ggml_blocks.unavailable_reason()})",
              file=sys.stderr)
        return 2
    binary = args.test_backend_ops or build_test_backend_ops()
    cpus = os.cpu_count() or 1
    threads = args.threads or max(1, cpus // 2)
    terms = ACTIVATION_PRECISIONS[args.activation_precision]
    rows = []
    for qtype in [t.strip() for t in args.types.split(",") if t.strip()]:
        nbytes = weight_bytes(qtype)
        rounds = [(llama_cpp_us(binary, qtype), stencil_us(qtype, threads, args.repeats, terms))
                  for _ in range(args.rounds)]
        theirs = None if None in [a for a, _ in rounds] else statistics.median(a for a, _ in rounds)
        ours = statistics.median(b for _, b in rounds)
        row = {"type": qtype, "weight_MB": nbytes / 1e6, "threads": threads, "rounds_us": rounds,
               "stencil_us": ours, "stencil_GBps": nbytes / ours / 1e3,
               "llama_cpp_us": theirs, "llama_cpp_GBps": nbytes / theirs / 1e3 if theirs else None}
        row["ratio"] = row["stencil_GBps"] / row["llama_cpp_GBps"] if theirs else None
        if cpus != threads:
            all_us = stencil_us(qtype, cpus, args.repeats, terms)
            row["stencil_all_threads_GBps"] = nbytes / all_us / 1e3
        rows.append(row)
        print(f"{qtype}: Stencil {row['stencil_GBps']:.1f} GB/s, llama.cpp "
              f"{row['llama_cpp_GBps'] or 0:.1f} GB/s ({row['ratio'] or 0:.2f}x) at {threads} thread(s)"
              + (f"; Stencil at {cpus}: {row['stencil_all_threads_GBps']:.1f} GB/s" if cpus != threads else ""),
              flush=True)
    report = {"command": " ".join(sys.argv), "cpu": cpu_model(), "shape": [M, K], "isa": ggml_blocks.isa(),
              "activation_precision": args.activation_precision, "test_backend_ops": str(binary), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
