"""Conformance of the JSON Schema grammar on MaskBench and the JSON-Schema-Test-Suite.

For each schema: compile it (our ``schema_to_regex`` → outlines-core ``Index`` over the
tokenizer's vocabulary, through ``grammar.compiler.GrammarCompiler`` with a per-schema time
limit); for each test instance, serialize it the way the grammar writes JSON (compact, keys in
schema order, see ``grammar.schema_canonical``), tokenize it, and check that the token-level
matcher accepts it (all tokens, then EOS) exactly when the instance is labelled valid. The
token-level verdict is the one counted; the regex verdict (Python ``re.fullmatch``) is recorded
next to it as ``regex_disagreements``. Along each valid instance the mask time per token
(``Matcher.fill_bitmask`` → ``Guide.write_mask_into``) is sampled.

A schema passes when it compiles, every valid instance is accepted and every invalid one
rejected (MaskBench's criterion, JSONSchemaBench, Geng et al. 2025, arXiv 2501.10868).
``compile_ms_p50/p99`` are over the schemas that compiled; ``answer_ms_p99`` over all of them,
errors and time-outs included (a time-out counts as the limit): how long a client waits for a
grammar or an error.

Usage: ``python -m benchmarks.conformance --corpus DIR [--limit N] [--timeout S] --json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = Path.home() / ".cache/stencil/models/SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, required=True,
                        help="MaskBench-format directory, or the JSON-Schema-Test-Suite root")
    parser.add_argument("--limit", type=int, default=None, help="N schemas, evenly spaced over the sorted files")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-schema compile limit, s")
    parser.add_argument("--mode", choices=("maskbench", "test-suite"), default="maskbench")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="tokenizer directory")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--failures", type=Path, default=None,
                        help="write one JSON line per failed schema here")


class _RegexTimeout(Exception):
    pass


def _alarm(_sig, _frame):
    raise _RegexTimeout


def _maskbench_cases(corpus: Path, limit: int | None):
    files = sorted(corpus.glob("*.json"))
    if limit is not None and limit < len(files):
        # Evenly spaced, so a small run still covers every MaskBench category.
        files = [files[i * len(files) // limit] for i in range(limit)]
    for f in files:
        d = json.loads(f.read_text())
        yield f.stem, d["schema"], [(t["data"], bool(t["valid"])) for t in d.get("tests", [])]


def _suite_cases(corpus: Path, limit: int | None):
    root = corpus / "tests" / "draft2020-12" if (corpus / "tests").exists() else corpus
    n = 0
    for f in sorted(root.rglob("*.json")):
        for gi, group in enumerate(json.loads(f.read_text())):
            if limit is not None and n >= limit:
                return
            schema = group["schema"]
            if _has_remote_ref(schema):
                continue
            if isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
            n += 1
            yield (f"{f.relative_to(root)}#{gi}", schema,
                   [(t["data"], bool(t["valid"])) for t in group["tests"]])


def _has_remote_ref(node) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(("http://", "https://")):
            return True
        return any(_has_remote_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_remote_ref(v) for v in node)
    return False


def _make_view(compiler):
    """``view(schema, value)`` for ``order_keys``: the effective schema the grammar used."""
    from grammar.json_schema.merge import MergeError, merge

    def view(schema, value, depth=0):
        if depth > 16 or not isinstance(schema, dict):
            return None
        try:
            flat: list = []
            compiler._flatten_all_of(schema, "#", flat)
            merged: object = True
            for m in flat:
                merged = merge(merged, m)
        except (MergeError, Exception):
            return None
        if not isinstance(merged, dict):
            return None
        for key in ("anyOf", "oneOf"):
            if isinstance(merged.get(key), list):
                rest = {k: v for k, v in merged.items() if k != key}
                for branch in merged[key]:
                    candidate = {"allOf": [rest, branch]} if rest else branch
                    if compiler.value_valid(value, candidate):
                        return view(candidate, value, depth + 1)
                return view(rest, value, depth + 1) if rest else None
        return merged

    return view


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_conformance(corpus: Path, limit: int | None = None, timeout_s: float = 10.0,
                    mode: str = "maskbench", model_dir: Path = DEFAULT_MODEL,
                    failures_path: Path | None = None) -> dict:
    """Run the benchmark; returns the report dict (keys listed in the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from grammar.base import GrammarError, GrammarSpec, GrammarTimeout
    from grammar.compiler import GrammarCompiler
    from grammar.json_schema import SchemaCompiler, SchemaOptions, schema_to_regex
    from grammar.json_schema.canonical import canonical_json, order_keys

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cases = _suite_cases(corpus, limit) if mode == "test-suite" else _maskbench_cases(corpus, limit)
    report = Counter()
    reasons: Counter = Counter()
    compile_ms: list[float] = []
    answered_ms: list[float] = []  # every schema's time to a grammar or an error (timeouts at the limit)
    mask_us: list[float] = []
    regex_disagree = 0
    regex_skipped = 0
    fail_lines = []
    signal.signal(signal.SIGALRM, _alarm)
    with GrammarCompiler(tokenizer, len(tokenizer), max_workers=1, timeout_s=timeout_s) as gc:
        bitmask = torch.zeros((1, gc.vocab.bitmask_words), dtype=torch.int32)
        for name, schema, tests in cases:
            report["schemas"] += 1
            if report["schemas"] % 100 == 0:
                print(f"{report['schemas']} schemas, {report['passed']} passed", file=sys.stderr,
                      flush=True)
            n_valid = sum(1 for _, v in tests if v)
            report["valid_instances"] += n_valid
            report["invalid_instances"] += len(tests) - n_valid
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                regex, _ = schema_to_regex(schema)
            except GrammarError as e:
                signal.setitimer(signal.ITIMER_REAL, 0)
                report["compile_errors"] += 1
                reasons[f"error:{e.keyword}"] += 1
                fail_lines.append({"name": name, "reason": f"error:{e.keyword}", "detail": str(e)})
                answered_ms.append((time.perf_counter() - t0) * 1e3)
                continue
            except _RegexTimeout:
                report["timeouts"] += 1
                reasons["timeout:regex"] += 1
                fail_lines.append({"name": name, "reason": "timeout:regex"})
                answered_ms.append((time.perf_counter() - t0) * 1e3)
                continue
            except RecursionError:
                signal.setitimer(signal.ITIMER_REAL, 0)
                report["compile_errors"] += 1
                reasons["error:recursion"] += 1
                answered_ms.append((time.perf_counter() - t0) * 1e3)
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            try:
                grammar = gc.compile(GrammarSpec.json_schema(schema))
            except GrammarTimeout:
                report["timeouts"] += 1
                reasons["timeout:index"] += 1
                fail_lines.append({"name": name, "reason": "timeout:index", "regex_len": len(regex)})
                answered_ms.append((time.perf_counter() - t0) * 1e3)
                continue
            except GrammarError as e:
                report["compile_errors"] += 1
                reason = "error:regex_too_large" if "characters" in e.message else f"error:index"
                reasons[reason] += 1
                fail_lines.append({"name": name, "reason": reason, "detail": str(e)})
                answered_ms.append((time.perf_counter() - t0) * 1e3)
                continue
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            answered_ms.append(compile_ms[-1])
            view = _make_view(SchemaCompiler(schema, SchemaOptions()))
            pyre = re.compile(regex)
            ok = True
            bad: list = []
            for data, valid in tests:
                try:
                    text = canonical_json(order_keys(data, schema, view))
                except (ValueError, TypeError):
                    text = json.dumps(data)
                ids = tokenizer.encode(text, add_special_tokens=False)
                m = grammar.matcher()
                accepted = True
                for tid in ids:
                    if valid:
                        t1 = time.perf_counter()
                        m.fill_bitmask(bitmask, 0)
                        mask_us.append((time.perf_counter() - t1) * 1e6)
                    if not m.accept_tokens([tid]):
                        accepted = False
                        break
                accepted = accepted and m.is_accepting()
                # Python's backtracking re can take exponential time on these regexes: bound it.
                signal.setitimer(signal.ITIMER_REAL, 0.5)
                try:
                    if accepted != bool(pyre.fullmatch(text)):
                        regex_disagree += 1
                except _RegexTimeout:
                    regex_skipped += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if valid:
                    report["valid_accepted"] += accepted
                else:
                    report["invalid_accepted"] += accepted
                if accepted != valid:
                    ok = False
                    bad.append({"valid": valid, "text": text[:300]})
            if ok:
                report["passed"] += 1
            else:
                kind = "fail:invalid_accepted" if any(not b["valid"] for b in bad) else "fail:valid_rejected"
                reasons[kind] += 1
                fail_lines.append({"name": name, "reason": kind, "cases": bad[:3]})
    keys = ("schemas", "passed", "compile_errors", "timeouts", "valid_instances", "valid_accepted",
            "invalid_instances", "invalid_accepted")
    out = {k: int(report[k]) for k in keys}
    out.update({
        "compile_ms_p50": _percentile(compile_ms, 0.5), "compile_ms_p99": _percentile(compile_ms, 0.99),
        "answer_ms_p99": _percentile(answered_ms, 0.99),
        "mask_us_p50": _percentile(mask_us, 0.5), "mask_us_p99": _percentile(mask_us, 0.99),
        "errors_by_reason": dict(reasons.most_common()), "regex_disagreements": regex_disagree,
        "regex_checks_timed_out": regex_skipped,
        "check": "token-level (outlines-core Index via grammar.matcher), regex recorded apart",
    })
    if failures_path is not None:
        failures_path.write_text("\n".join(json.dumps(x) for x in fail_lines) + "\n")
    return out


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """Run as ``stencil bench conformance`` (parsed ``args``) or as a module (``argv`` list)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args)
    report = run_conformance(args.corpus, args.limit, args.timeout, args.mode, args.model,
                             args.failures)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
