"""Run MaskBench's own harness (JSONSchemaBench ``maskbench/``) on Stencil and on llguidance in
the same run, through Stencil's public grammar API only, and report the issue's columns per engine.

The harness is not part of Stencil: check it out (``git clone
https://github.com/guidance-ai/jsonschemabench``) and pass its ``maskbench`` folder. This module
supplies the one thing the harness needs from an engine, an ``Engine`` subclass
(``compile_grammar``, ``reset``, ``compute_mask``, ``commit_token``) written over
``GrammarCompiler`` / ``GrammarSpec.json_schema`` / ``CompiledGrammar.matcher`` /
``GrammarMatcher.fill_bitmask`` / ``accept_tokens`` / ``is_accepting``; llguidance runs through
the harness's own ``LlgEngine`` (one fix for numpy 2: its bit test ``int32 & (1 << 31)``
overflows, so the word is read as a Python int). Each schema goes through the harness's own
``process_file`` for both engines back to back (the order alternates from schema to schema), so a
drift of the machine's speed hits both alike: compare the engines by their ratio, not across runs.

As the harness does for every engine, each schema is compiled fresh: Stencil's compiler keeps no
compiled grammar (``cache_size=0``); what it may reuse is its translation cache of sub-schemas
(``stencil.grammar.json_schema``), as a server would across requests.

The harness feeds each instance as ``json.dumps(data)`` (``", "`` and ``": "`` separators, keys in
the instance's order) and checks each token against the mask; so Stencil runs with flexible
whitespace, and an instance whose keys are not in schema order is refused (Stencil writes
properties in schema order; so does llguidance).

Columns per engine (the harness's own timings, ``time.monotonic``): ``passed`` (every valid
instance accepted, every invalid one refused), ``invalid_accepted`` (schemas where an invalid
instance got through: must be 0), ``compile_errors``, ``ttfm_ms_p50/p99`` (compile and first mask,
over the schemas that compiled), ``mask_us_p50/p99`` (one mask and one token commit, over every
token the harness fed), and the ratios Stencil / llguidance.

Usage: ``stencil bench maskbench --harness JSONSCHEMABENCH --corpus DIR [--limit N]
[--engines stencil,llguidance] [--additional-properties schema] --json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def default_model() -> Path:
    """The default model's GGUF file (``make setup`` fetches it; fetched here if missing): whose
    tokenizer the grammar benchmarks use when no ``--model`` is given."""
    from stencil.engine.models.default_model import ensure_default_model

    return ensure_default_model(lambda line: print(line, file=sys.stderr, flush=True))
ENGINES = ("stencil", "llguidance")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--harness", type=Path, required=True, help="a checkout of JSONSchemaBench (the folder that holds its maskbench/ package)")
    parser.add_argument("--corpus", type=Path, required=True, help="MaskBench-format schema files")
    parser.add_argument("--limit", type=int, default=None, help="N schemas, evenly spaced")
    parser.add_argument("--timeout", type=float, default=10.0, help="Stencil's compile limit, s")
    parser.add_argument("--whitespace", choices=("compact", "flexible"), default="flexible")
    parser.add_argument("--additional-properties", choices=("closed", "schema"), default="closed",
                        help="Stencil's objects that say nothing of additionalProperties: closed (no "
                             "undeclared key, the server's default) or schema (any, as JSON Schema says)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated: stencil, llguidance (both by default, in the same run)")
    parser.add_argument("--model", type=Path, default=None,
                        help="model whose tokenizer to use: a .gguf file, a directory with one, or an HF directory "
                             "(default: the default model's GGUF)")
    parser.add_argument("--compare", type=Path, default=None,
                        help="a `stencil bench conformance --failures` file to compare Stencil's verdicts with")
    parser.add_argument("--json", type=Path, default=None)


def stencil_engine(engine_base, whitespace: str, timeout_s: float, additional_properties: str = "closed"):
    """The harness ``Engine`` subclass over Stencil's public grammar API."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.bitmask import allocate_bitmask
    from stencil.grammar.compiler import GrammarCompiler

    class StencilEngine(engine_base):
        def get_id(self):
            return "stencil"

        def get_name(self):
            return "Stencil"

        def get_module(self):
            return "stencil-serve"

        def init(self):
            self.compiler = GrammarCompiler(self.tokenizer, len(self.tokenizer), max_workers=1,
                                            timeout_s=timeout_s, cache_size=0)
            self.bitmask = allocate_bitmask(1, len(self.tokenizer))
            self.words = self.bitmask[0].numpy()  # the same memory, read without torch indexing
            self.compiler.warm_up()  # what a server pays once at start, not on the first schema's clock

        def compile_grammar(self, schema: dict):
            self.grammar = self.compiler.compile(GrammarSpec.json_schema(
                schema, whitespace=whitespace, additional_properties=additional_properties))
            self.reset()
            self.compute_mask()  # the harness's time to first mask includes the first mask

        def reset(self):
            # The last instance's cursor is finished: dropped before the next one is made, as a
            # server drops a finished request's. Its llguidance matcher, with the lexer states
            # it built, then serves the next instance (``LazyGrammar._give_back``); made while
            # the old one is still held, each cursor got a fresh copy of the root instead, and
            # rebuilt those states (harness masks p50 / p99 1.00x / 1.02x llguidance's -> 0.88x /
            # 0.97x on maskbench-dev).
            self.matcher = None
            self.matcher = self.grammar.matcher()

        def compute_mask(self):
            self.matcher.fill_bitmask(self.bitmask, 0)

        def commit_token(self, t: int) -> bool:
            if not (int(self.words[t >> 5]) >> (t & 31)) & 1:
                return False
            return self.matcher.accept_tokens([t])

    return StencilEngine


def llguidance_engine(llg_engine_base):
    """The harness's own llguidance engine, with two changes: its bit test reads the word as a
    Python int (numpy 2: ``int32 & (1 << 31)`` overflows), and ``compile_grammar`` computes the
    first mask, as Stencil's does, so that both engines' time to first mask is what its name says
    (the harness's own engine stops at the constructor; ``compile_ms`` keeps that figure)."""
    import time

    class LlguidanceEngine(llg_engine_base):
        def init(self):
            super().init()
            self.compile_ms: list[float] = []

        def compile_grammar(self, schema: dict):
            t0 = time.monotonic()
            super().compile_grammar(schema)
            self.compile_ms.append((time.monotonic() - t0) * 1e3)
            self.compute_mask()

        def commit_token(self, t: int) -> bool:
            ok = (int(self.mask_data[0, t >> 5]) >> (t & 31)) & 1 == 1
            if ok:
                self.interp.consume_token(t)
            elif self.interp.is_error():
                raise ValueError(self.interp.get_error())
            return ok

    return LlguidanceEngine


def cpu_model() -> str:
    """The CPU's model name (what ``lscpu`` prints), for the report."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _pct(xs: list[float], q: float) -> float | None:
    """The harness's percentile convention: the sorted value at round(q * (n - 1))."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(statuses: dict[str, dict]) -> dict:
    """The issue's columns from the harness's per-schema statuses (name → status)."""
    passed, failed, invalid, errors = [], {}, [], 0
    ttfm, masks = [], []
    for name, status in statuses.items():
        masks.extend(status.get("all_mask_us", []))
        if "compile_error" in status:
            errors += 1
            failed[name] = "compile_error: " + status["compile_error"][:200]
            continue
        ttfm.append(status["ttfm_us"] / 1e3)
        if "validation_error" in status:
            failed[name] = status["validation_error"]
            if "should reject" in status["validation_error"]:
                invalid.append(name)
        else:
            passed.append(name)
    n = len(statuses)
    return {"schemas": n, "passed": len(passed), "passed_fraction": round(len(passed) / n, 4) if n else None,
            "invalid_accepted": len(invalid), "invalid_accepted_schemas": invalid, "compile_errors": errors,
            "ttfm_ms_p50": _pct(ttfm, 0.5), "ttfm_ms_p99": _pct(ttfm, 0.99),
            "mask_us_p50": _pct(masks, 0.5), "mask_us_p99": _pct(masks, 0.99), "masks": len(masks),
            "failed": failed}


def _ratios(ours: dict, theirs: dict) -> dict:
    out = {}
    for k in ("ttfm_ms_p50", "ttfm_ms_p99", "mask_us_p50", "mask_us_p99"):
        if ours.get(k) and theirs.get(k):
            out[k] = round(ours[k] / theirs[k], 3)
    return out


def run(harness: Path, corpus: Path, limit: int | None, timeout_s: float, whitespace: str,
        model_dir: Path | None, compare: Path | None = None, engines: tuple[str, ...] = ENGINES,
        additional_properties: str = "closed") -> dict:
    """Both engines through the harness's ``process_file``, schema by schema; the report."""
    sys.path.insert(0, str(harness))
    from maskbench import runner  # the harness's own code
    from maskbench.engine import Engine

    from stencil.engine.models.tokenizer import load_tokenizer

    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}; known: {ENGINES}")
    tokenizer = load_tokenizer(model_dir or default_model())
    live = {}
    for name in engines:
        if name == "stencil":
            engine = stencil_engine(Engine, whitespace, timeout_s, additional_properties)()
        else:
            from maskbench.llg_engine import LlgEngine

            engine = llguidance_engine(LlgEngine)()
        engine.multi = False
        engine.debug = False
        engine.tokenizer = tokenizer
        engine.log_single = lambda s: None
        engine.init()
        live[name] = engine
    files = sorted(corpus.glob("*.json"))
    if limit is not None and limit < len(files):
        files = [files[i * len(files) // limit] for i in range(limit)]
    out_root = Path(tempfile.mkdtemp(prefix="maskbench-"))
    statuses: dict[str, dict[str, dict]] = {name: {} for name in live}
    order = list(live)
    for i, f in enumerate(files):
        for name in (order if i % 2 == 0 else order[::-1]):
            runner.output_path = str(out_root / name)
            os.makedirs(runner.output_path, exist_ok=True)
            statuses[name][f.stem] = runner.process_file(live[name], str(f))
    if "stencil" in live:
        live["stencil"].compiler.close()
    report = {"schemas": len(files), "whitespace": whitespace, "additional_properties": additional_properties,
              "cpu": cpu_model(),
              "harness_output": str(out_root), "engines": {name: _summary(s) for name, s in statuses.items()}}
    if "llguidance" in live:
        ms = live["llguidance"].compile_ms
        report["engines"]["llguidance"].update(compile_only_ms_p50=_pct(ms, 0.5), compile_only_ms_p99=_pct(ms, 0.99))
    if "stencil" in live and "llguidance" in live:
        report["ratio_stencil_to_llguidance"] = _ratios(report["engines"]["stencil"],
                                                        report["engines"]["llguidance"])
        report["both_compiled"] = _paired(statuses["stencil"], statuses["llguidance"])
        try:
            from importlib.metadata import version

            report["llguidance_version"] = version("llguidance")
        except Exception:  # noqa: BLE001 - the version is a label only
            pass
    if compare is not None and "stencil" in live:
        report["disagreements"] = _disagreements(compare, {f.stem for f in files},
                                                 report["engines"]["stencil"]["failed"])
    return report


def _paired(ours: dict[str, dict], theirs: dict[str, dict]) -> dict:
    """Time to first mask and masks over the schemas both engines compiled (each engine's own
    columns include the schemas only it compiles, which for Stencil are the hard ones: a
    ``oneOf`` of overlapping string patterns, written with ``& ~``, masks at ~0.4 ms a token)."""
    names = [n for n in ours if "compile_error" not in ours[n] and "compile_error" not in theirs.get(n, {"compile_error": 1})]
    a = [ours[n]["ttfm_us"] / 1e3 for n in names]
    b = [theirs[n]["ttfm_us"] / 1e3 for n in names]
    ma = [us for n in names for us in ours[n].get("all_mask_us", [])]
    mb = [us for n in names for us in theirs[n].get("all_mask_us", [])]
    out = {"schemas": len(names), "stencil_ttfm_ms_p50": _pct(a, 0.5), "stencil_ttfm_ms_p99": _pct(a, 0.99),
           "llguidance_ttfm_ms_p50": _pct(b, 0.5), "llguidance_ttfm_ms_p99": _pct(b, 0.99),
           "stencil_mask_us_p50": _pct(ma, 0.5), "stencil_mask_us_p99": _pct(ma, 0.99),
           "llguidance_mask_us_p50": _pct(mb, 0.5), "llguidance_mask_us_p99": _pct(mb, 0.99)}
    if names:
        out["ratio_p50"] = round(out["stencil_ttfm_ms_p50"] / out["llguidance_ttfm_ms_p50"], 3)
        out["ratio_p99"] = round(out["stencil_ttfm_ms_p99"] / out["llguidance_ttfm_ms_p99"], 3)
    if ma and mb:
        out["mask_ratio_p50"] = round(out["stencil_mask_us_p50"] / out["llguidance_mask_us_p50"], 3)
        out["mask_ratio_p99"] = round(out["stencil_mask_us_p99"] / out["llguidance_mask_us_p99"], 3)
    return out


def _disagreements(compare: Path, names: set[str], failed: dict[str, str]) -> dict:
    """Schemas that fail in the harness only, or in ``bench conformance`` only."""
    ours = {}
    for line in compare.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            if d.get("backend") in ("lazy", "all"):
                ours[d["name"]] = d["reason"]
    only_harness = sorted(n for n in names if n in failed and n not in ours)
    only_bench = sorted(n for n in names if n in ours and n not in failed)
    return {"fail_in_harness_only": {n: failed[n] for n in only_harness},
            "fail_in_conformance_only": {n: ours[n] for n in only_bench}}


def format_table(report: dict) -> str:
    """The issue's table: one row per engine, then the ratios."""
    rows = ["| engine | passed | invalid accepted | first mask p50 / p99 | mask p50 / p99 |",
            "|---|---|---|---|---|"]
    for name, r in report["engines"].items():
        def num(x, unit, digits):
            return "-" if x is None else f"{x:.{digits}f} {unit}"

        rows.append(f"| {name} | {r['passed']} ({100 * (r['passed_fraction'] or 0):.1f}%) | "
                    f"{r['invalid_accepted']} | {num(r['ttfm_ms_p50'], 'ms', 2)} / {num(r['ttfm_ms_p99'], 'ms', 1)} | "
                    f"{num(r['mask_us_p50'], 'us', 0)} / {num(r['mask_us_p99'], 'us', 0)} |")
    ratio = report.get("ratio_stencil_to_llguidance")
    if ratio:
        rows.append("")
        rows.append("Stencil / llguidance: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    paired = report.get("both_compiled")
    if paired and paired.get("schemas"):
        rows.append(f"On the {paired['schemas']} schemas both compiled, first mask p50 / p99: Stencil "
                    f"{paired['stencil_ttfm_ms_p50']:.2f} / {paired['stencil_ttfm_ms_p99']:.1f} ms, llguidance "
                    f"{paired['llguidance_ttfm_ms_p50']:.2f} / {paired['llguidance_ttfm_ms_p99']:.1f} ms "
                    f"({paired['ratio_p50']:.2f}x / {paired['ratio_p99']:.2f}x)")
        if paired.get("mask_ratio_p50") is not None:
            rows.append(f"On the same schemas, mask p50 / p99: Stencil {paired['stencil_mask_us_p50']:.0f} / "
                        f"{paired['stencil_mask_us_p99']:.0f} us, llguidance {paired['llguidance_mask_us_p50']:.0f} / "
                        f"{paired['llguidance_mask_us_p99']:.0f} us ({paired['mask_ratio_p50']:.2f}x / "
                        f"{paired['mask_ratio_p99']:.2f}x)")
    rows.append(f"{report['schemas']} schemas, {report['whitespace']} whitespace, CPU: {report['cpu']}")
    return "\n".join(rows)


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args)
    if not (args.harness / "maskbench" / "runner.py").exists():
        print(f"{args.harness} is not a JSONSchemaBench checkout (no maskbench/runner.py in it)",
              file=sys.stderr)
        return 2
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not engines or set(engines) - set(ENGINES):
        print(f"--engines takes a comma-separated subset of {', '.join(ENGINES)}, got {args.engines!r}",
              file=sys.stderr)
        return 2
    report = run(args.harness, args.corpus, args.limit, args.timeout, args.whitespace, args.model,
                 args.compare, engines, args.additional_properties)
    report["command"] = "stencil bench maskbench " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "maskbench"]
                                                              else sys.argv[1:])
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
