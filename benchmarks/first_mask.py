"""A user's first schema in a fresh process: compile + first mask, with and without the compiler's
warm-up (``GrammarCompiler.warm_up``), and the same schema right after.

Each measurement is its own child process (``python -m stencil.benchmarks.first_mask --child``),
so each first compile is a process's first: the child loads the tokenizer, builds a
``GrammarCompiler`` as the MaskBench adapter does (``max_workers=1``, ``cache_size=0``: the second
compile of the schema is a full compile too, not a cache hit), waits for ``warm_up()`` or not,
then times ``compile`` + ``matcher()`` + ``fill_bitmask`` twice on one schema of the corpus.
Without the wait the first compile meets the warm-up that the constructor started in the
background (what a server reporting healthy before it had finished would show).

Usage: ``stencil bench first_mask --corpus ../shared/corpora/maskbench-dev [--limit 6]
[--model DIR] [--json PATH]``. Columns, ms: ``cold_first`` / ``cold_again`` (no wait),
``warm_first`` / ``warm_again`` (after ``warm_up()``), ``warm_up_ms`` (the wait itself).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from stencil.benchmarks.maskbench_harness import cpu_model, default_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, required=True, help="MaskBench-format schema files")
    parser.add_argument("--limit", type=int, default=6, help="N schemas, evenly spaced (each costs two processes)")
    parser.add_argument("--model", type=Path, default=None,
                        help="model whose tokenizer to use (default: the default model's GGUF)")
    parser.add_argument("--json", type=Path, default=None)


def _child(schema_file: Path, model: Path, wait: bool) -> dict:
    """One fresh process's figures (ms): the first compile + mask of the schema, then again."""
    from stencil.engine.models.tokenizer import load_tokenizer
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.bitmask import allocate_bitmask
    from stencil.grammar.compiler import GrammarCompiler

    schema = json.loads(schema_file.read_text())["schema"]
    tokenizer = load_tokenizer(model)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), max_workers=1, cache_size=0)
    bitmask = allocate_bitmask(1, len(tokenizer))
    start = time.perf_counter()
    if wait:
        compiler.warm_up()
    out = {"warm_up_ms": (time.perf_counter() - start) * 1e3 if wait else None}
    for name in ("first", "again"):
        start = time.perf_counter()
        try:
            compiler.compile(GrammarSpec.json_schema(schema, whitespace="flexible")).matcher().fill_bitmask(bitmask, 0)
        except Exception as e:  # noqa: BLE001 - a schema Stencil refuses: reported, not timed
            return {"error": f"{type(e).__name__}: {e}"}
        out[name] = (time.perf_counter() - start) * 1e3
    compiler.close()
    return out


def run(corpus: Path, limit: int, model: Path) -> dict:
    """Two child processes per schema (no wait, then ``warm_up()``); the rows and the CPU."""
    files = sorted(corpus.glob("*.json"))
    if limit < len(files):
        files = [files[i * len(files) // limit] for i in range(limit)]
    rows = []
    for f in files:
        row: dict = {"schema": f.name}
        for mode, flag in (("cold", "--no-wait"), ("warm", "--wait")):
            done = subprocess.run([sys.executable, "-m", "stencil.benchmarks.first_mask", "--child", str(f),
                                   str(model), flag], capture_output=True, text=True, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            if "error" in got:
                row["error"] = got["error"]
                break
            row[f"{mode}_first"], row[f"{mode}_again"] = got["first"], got["again"]
            if got["warm_up_ms"] is not None:
                row["warm_up_ms"] = got["warm_up_ms"]
        rows.append(row)
    return {"cpu": cpu_model(), "model": str(model), "rows": rows}


def main(args: argparse.Namespace) -> int:
    report = run(args.corpus, args.limit, args.model or default_model())
    print(f"CPU: {report['cpu']}")
    cols = ("cold_first", "cold_again", "warm_first", "warm_again", "warm_up_ms")
    print(f"{'schema':44s} " + " ".join(f"{c:>11s}" for c in cols))
    for row in report["rows"]:
        if "error" in row:
            print(f"{row['schema']:44s} refused: {row['error'][:60]}")
            continue
        print(f"{row['schema']:44s} " + " ".join(f"{row[c]:11.1f}" for c in cols))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _, _, schema_path, model_path, flag = sys.argv
    print(json.dumps(_child(Path(schema_path), Path(model_path), flag == "--wait")))
