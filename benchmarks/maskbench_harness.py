"""Run MaskBench's own harness (JSONSchemaBench ``maskbench/``) on Stencil, through the public
grammar API only, and compare its verdicts with ``stencil bench conformance``.

The harness is not part of Stencil: check it out (``git clone
https://github.com/guidance-ai/jsonschemabench``) and pass its ``maskbench`` folder. This module
supplies the one thing the harness needs from an engine, an ``Engine`` subclass
(``compile_grammar``, ``reset``, ``compute_mask``, ``commit_token``) written over
``GrammarCompiler`` / ``GrammarSpec.json_schema`` / ``CompiledGrammar.matcher`` /
``GrammarMatcher.fill_bitmask`` / ``accept_tokens``; then it calls the harness's own
``process_file`` for every schema and reads back its statuses.

The harness feeds each instance as ``json.dumps(data)`` (``", "`` and ``": "`` separators, keys in
the instance's order) and checks each token against the mask; so Stencil runs with flexible
whitespace, and an instance whose keys are not in schema order is refused (Stencil writes
properties in schema order).

Usage: ``stencil bench maskbench --harness PATH/maskbench --corpus DIR [--limit N] --json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = Path.home() / ".cache/stencil/models/SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--harness", type=Path, required=True, help="the jsonschemabench maskbench/ folder")
    parser.add_argument("--corpus", type=Path, required=True, help="MaskBench-format schema files")
    parser.add_argument("--limit", type=int, default=None, help="N schemas, evenly spaced")
    parser.add_argument("--timeout", type=float, default=10.0, help="Stencil's compile limit, s")
    parser.add_argument("--whitespace", choices=("compact", "flexible"), default="flexible")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="model whose tokenizer to use: a .gguf file, a directory with one, or an HF directory")
    parser.add_argument("--compare", type=Path, default=None,
                        help="a `stencil bench conformance --failures` file to compare verdicts with")
    parser.add_argument("--json", type=Path, default=None)


def stencil_engine(engine_base, whitespace: str, timeout_s: float):
    """The harness ``Engine`` subclass over Stencil's public grammar API."""
    import torch

    from grammar.base import GrammarSpec
    from grammar.bitmask import allocate_bitmask
    from grammar.compiler import GrammarCompiler
    from grammar.frontend import warm_up

    class StencilEngine(engine_base):
        def get_id(self):
            return "stencil"

        def get_name(self):
            return "Stencil"

        def get_module(self):
            return "stencil-serve"

        def init(self):
            self.compiler = GrammarCompiler(self.tokenizer, len(self.tokenizer), max_workers=1,
                                            timeout_s=timeout_s)
            self.bitmask = allocate_bitmask(1, len(self.tokenizer))
            warm_up()  # what a server pays once at start, not on the first schema's clock

        def compile_grammar(self, schema: dict):
            self.grammar = self.compiler.compile(GrammarSpec.json_schema(schema, whitespace=whitespace))
            self.reset()
            self.compute_mask()  # the harness's time to first mask includes the first mask

        def reset(self):
            self.matcher = self.grammar.matcher()

        def compute_mask(self):
            self.matcher.fill_bitmask(self.bitmask, 0)

        def commit_token(self, t: int) -> bool:
            if not (int(self.bitmask[0, t >> 5]) >> (t & 31)) & 1:
                return False
            return self.matcher.accept_tokens([t])

    _ = torch  # the bitmask is a torch tensor
    return StencilEngine


def run(harness: Path, corpus: Path, limit: int | None, timeout_s: float, whitespace: str,
        model_dir: Path, compare: Path | None = None) -> dict:
    sys.path.insert(0, str(harness))
    from maskbench import runner  # the harness's own code
    from maskbench.engine import Engine

    from engine.models.tokenizer import load_tokenizer

    engine = stencil_engine(Engine, whitespace, timeout_s)()
    engine.multi = False
    engine.debug = False
    engine.tokenizer = load_tokenizer(model_dir)
    engine.log_single = lambda s: None
    engine.init()
    files = sorted(corpus.glob("*.json"))
    if limit is not None and limit < len(files):
        files = [files[i * len(files) // limit] for i in range(limit)]
    out_dir = Path(tempfile.mkdtemp(prefix="maskbench-stencil-"))
    runner.output_path = str(out_dir)
    passed, failed = [], {}
    ttfm, masks = [], []
    for f in files:
        status = runner.process_file(engine, str(f))
        name = f.stem
        ttfm.append(status["ttfm_us"] / 1e3)
        masks.extend(status.get("all_mask_us", []))
        if "compile_error" in status:
            failed[name] = "compile_error: " + status["compile_error"][:200]
        elif "validation_error" in status:
            failed[name] = status["validation_error"]
        else:
            passed.append(name)
    engine.compiler.close()
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None  # noqa: E731
    report = {"schemas": len(files), "passed": len(passed), "passed_fraction": round(len(passed) / len(files), 4),
              "whitespace": whitespace, "ttfm_ms_p50": pct(ttfm, 0.5), "ttfm_ms_p99": pct(ttfm, 0.99),
              "mask_us_p50": pct(masks, 0.5), "mask_us_p99": pct(masks, 0.99),
              "failed": failed}
    if compare is not None:
        ours = {}
        for line in compare.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                if d.get("backend") in ("lazy", "all"):
                    ours[d["name"]] = d["reason"]
        names = {f.stem for f in files}
        only_harness = sorted(n for n in names if n in failed and n not in ours)
        only_bench = sorted(n for n in names if n in ours and n not in failed)
        report["disagreements"] = {"fail_in_harness_only": {n: failed[n] for n in only_harness},
                                   "fail_in_conformance_only": {n: ours[n] for n in only_bench}}
    return report


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args)
    if not (args.harness / "maskbench" / "runner.py").exists():
        print(f"{args.harness} is not the jsonschemabench maskbench/ folder (no maskbench/runner.py)",
              file=sys.stderr)
        return 2
    report = run(args.harness, args.corpus, args.limit, args.timeout, args.whitespace, args.model, args.compare)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("failed", "disagreements")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
