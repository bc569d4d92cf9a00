"""Conformance and speed of the JSON Schema grammar, per backend, on MaskBench or the test suite.

For each schema the front end runs once (``stencil.grammar.frontend.to_program``: our JSON Schema compiler,
a regex, or a Lark grammar where the schema is recursive); then each backend builds its grammar
from that program (``eager``: outlines-core index in a child process, limited to ``--timeout``;
``lazy``: llguidance) and answers every test instance: serialized the way the grammar writes JSON
(compact, keys in schema order, see ``stencil.grammar.json_schema.canonical``), tokenized, fed token by
token to a matcher, accepted when every token is and the matcher is accepting at the end. A schema
passes when every valid instance is accepted and every invalid one rejected (MaskBench's
criterion, JSONSchemaBench, Geng et al. 2025, arXiv 2501.10868).

Per backend: ``passed``, ``invalid_accepted``, ``compile_ms_p50/p99`` (front end + build, over the
schemas that compiled), ``first_mask_ms_p50/p99`` (front end + build + the first mask: what a
request waits before its first token can be sampled), ``answer_ms_p99/max`` (the same over every
schema, errors and time-outs included), ``mask_us_p50/p99`` (one mask per token along the valid
instances) and ``errors_by_reason``.

``auto`` is the serving policy: every request starts on the lazy matcher, so its time to first mask,
verdicts and answers are the lazy backend's; its masks (``mask_us``) are those of the steady state
of a grammar in use: the eager index where it builds within the limit (it is built in the
background once a grammar is reused; ``steady_state_eager`` schemas), else the lazy matcher once
earlier requests have built its lexer states (the valid instances walked a second time, on fresh
matchers; ``steady_state_lazy``). The lazy backend's own ``mask_us`` is the cold walk: what the
first requests on a grammar see. ``--step-share`` also loads the model and reports the bitmask of a
decode step of 32 structured rows as a share of that step.

Usage: ``stencil bench conformance --corpus DIR [--limit N] [--timeout S] [--backends eager,lazy,auto]
[--whitespace compact|flexible] [--step-share] --json PATH``.
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
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, required=True,
                        help="MaskBench-format directory, or the JSON-Schema-Test-Suite root")
    parser.add_argument("--limit", type=int, default=None, help="N schemas, evenly spaced over the sorted files")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-schema compile limit, s")
    parser.add_argument("--mode", choices=("maskbench", "test-suite"), default="maskbench")
    parser.add_argument("--model", type=Path, default=None,
                        help="model whose tokenizer (and, for --step-share, forward) to use: a .gguf file, a "
                             "directory with one, or an HF directory (default: the default model's GGUF)")
    parser.add_argument("--backends", default="eager,lazy,auto",
                        help="comma-separated: eager, lazy, auto (auto needs lazy; eager adds its masks)")
    parser.add_argument("--whitespace", choices=("compact", "flexible"), default="flexible",
                        help="JSON layout (default: the server's default, flexible)")
    parser.add_argument("--step-share", action="store_true",
                        help="also time the bitmask of a 32-row decode step against the model's step")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--failures", type=Path, default=None,
                        help="write one JSON line per failed schema and backend here")


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


def _warm_masks(grammar, texts, bitmask) -> list[float]:
    """Mask times (us) along the valid instances, walked again on fresh matchers of ``grammar``
    after the measured walk: the lazy matcher of a grammar in use, whose lexer states are built."""
    out: list[float] = []
    for _, ids, valid in texts:
        if not valid:
            continue
        m = grammar.matcher()
        try:
            for tid in ids:
                t = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                out.append((time.perf_counter() - t) * 1e6)
                if not m.accept_tokens([tid]):
                    break
        except RuntimeError:
            pass
    return out


def _make_view(compiler):
    """``view(schema, value)`` for ``order_keys``: the effective schema the grammar used."""
    from stencil.grammar.json_schema.merge import MergeError, merge

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


@dataclass(slots=True)
class _Tally:
    """One backend's results."""

    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    compile_ms: list[float] = field(default_factory=list)
    first_mask_ms: list[float] = field(default_factory=list)
    answer_ms: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)

    def fail(self, reason: str, answer_ms: float) -> None:
        self.reasons[reason] += 1
        self.answer_ms.append(answer_ms)

    def report(self) -> dict:
        c = self.counts
        return {
            "schemas": c["schemas"], "passed": c["passed"],
            "passed_fraction": round(c["passed"] / c["schemas"], 4) if c["schemas"] else None,
            "compiled": c["compiled"], "valid_accepted": c["valid_accepted"],
            "invalid_accepted": c["invalid_accepted"],
            "compile_ms_p50": _percentile(self.compile_ms, 0.5), "compile_ms_p99": _percentile(self.compile_ms, 0.99),
            "first_mask_ms_p50": _percentile(self.first_mask_ms, 0.5),
            "first_mask_ms_p99": _percentile(self.first_mask_ms, 0.99),
            "answer_ms_p99": _percentile(self.answer_ms, 0.99),
            "answer_ms_max": max(self.answer_ms) if self.answer_ms else None,
            "mask_us_p50": _percentile(self.mask_us, 0.5), "mask_us_p99": _percentile(self.mask_us, 0.99),
            "errors_by_reason": dict(self.reasons.most_common()),
        }


def _reason(e) -> str:
    from stencil.grammar.base import GrammarTimeout

    if isinstance(e, GrammarTimeout):
        return "timeout"
    msg = getattr(e, "message", str(e))
    if "characters, above the limit" in msg:
        return "error:regex_too_large"
    if "too large" in msg:
        return "error:index_too_large"
    kw = getattr(e, "keyword", None)
    return f"error:{kw}" if kw else "error:other"


def run_conformance(corpus: Path, limit: int | None = None, timeout_s: float = 10.0,
                    mode: str = "maskbench", model_dir: Path | None = None,
                    failures_path: Path | None = None, backends: tuple[str, ...] = ("eager", "lazy", "auto"),
                    whitespace: str = "flexible", step_share: bool = False) -> dict:
    """Run the benchmark; returns the report (keys in the module docstring)."""
    import torch

    from stencil.engine.models.tokenizer import load_tokenizer
    from stencil.grammar.backends.eager import EagerBackend
    from stencil.grammar.backends.lazy import LazyBackend
    from stencil.grammar.base import GrammarError, GrammarSpec, Program
    from stencil.grammar.frontend import to_program, warm_up
    from stencil.grammar.json_schema import SchemaCompiler, SchemaOptions
    from stencil.grammar.json_schema.canonical import canonical_json, order_keys
    from stencil.grammar.vocab import build_vocabulary

    from stencil.benchmarks.maskbench_harness import default_model

    if "auto" in backends and "lazy" not in backends:
        backends = ("lazy", *backends)
    model_dir = model_dir or default_model()
    tokenizer = load_tokenizer(model_dir)
    vocab = build_vocabulary(tokenizer, len(tokenizer))
    built = {}
    if "lazy" in backends:
        built["lazy"] = LazyBackend(vocab)
    if "eager" in backends:
        built["eager"] = EagerBackend(vocab, timeout_s=timeout_s)
    tallies = {b: _Tally() for b in backends}
    cases = _suite_cases(corpus, limit) if mode == "test-suite" else _maskbench_cases(corpus, limit)
    bitmask = torch.zeros((1, vocab.bitmask_words), dtype=torch.int32)
    fail_lines: list[dict] = []
    regex_disagree = regex_skipped = 0
    kinds = Counter()
    samples: list[tuple[object, list[int]]] = []  # (lazy grammar, a valid instance's tokens) for --step-share
    signal.signal(signal.SIGALRM, _alarm)
    warm_up()  # one-time translation costs, paid by a server when it starts, not on a request
    n_schemas = 0
    for name, schema, tests in cases:
        n_schemas += 1
        if n_schemas % 100 == 0:
            print(f"{n_schemas} schemas, " + ", ".join(f"{b} {t.counts['passed']}" for b, t in tallies.items()),
                  file=sys.stderr, flush=True)
        for t in tallies.values():
            t.counts["schemas"] += 1
        spec = GrammarSpec.json_schema(schema, whitespace=whitespace)
        t0 = time.perf_counter()
        try:
            program = to_program(spec, deadline=time.monotonic() + timeout_s)
        except (GrammarError, RecursionError) as e:
            ms = (time.perf_counter() - t0) * 1e3
            reason = _reason(e) if isinstance(e, GrammarError) else "error:recursion"
            for b, t in tallies.items():
                t.fail(reason, ms)
            fail_lines.append({"name": name, "backend": "all", "reason": reason, "detail": str(e)[:300]})
            continue
        front_ms = (time.perf_counter() - t0) * 1e3
        kinds[program.kind] += 1
        view = _make_view(SchemaCompiler(schema, SchemaOptions()))
        texts = []
        for data, valid in tests:
            try:
                text = canonical_json(order_keys(data, schema, view))
            except (ValueError, TypeError):
                text = json.dumps(data)
            texts.append((text, tokenizer.encode(text, add_special_tokens=False), valid))
        verdicts: dict[str, list[bool] | None] = {}
        masks: dict[str, list[float]] = {}
        for b in ("lazy", "eager"):
            if b not in built:
                continue
            tally = tallies[b]
            prog = program
            t1 = time.perf_counter()
            try:
                if b == "eager" and program.kind == "json":
                    # Handed to llguidance's JSON front end: the index is of Stencil's own
                    # translation, the same language (stencil.grammar.json_schema.handover).
                    prog = to_program(spec, deadline=time.monotonic() + timeout_s, handover=False)
                if b == "eager" and prog.kind == "lark":
                    # What `--grammar-backend eager` serves for a recursive schema: the unrolled regex.
                    prog = to_program(spec, deadline=time.monotonic() + timeout_s, grammar=False)
                grammar = built[b].build(prog, spec) if b == "eager" else built[b].build(prog)
                m = grammar.matcher()
                m.fill_bitmask(bitmask, 0)
            except GrammarError as e:
                ms = front_ms + (time.perf_counter() - t1) * 1e3
                tally.fail(_reason(e), ms)
                verdicts[b] = None
                fail_lines.append({"name": name, "backend": b, "reason": _reason(e), "detail": str(e)[:300]})
                continue
            first_ms = front_ms + (time.perf_counter() - t1) * 1e3
            if b == "lazy":
                lazy_grammar = grammar
            tally.counts["compiled"] += 1
            tally.compile_ms.append(first_ms)
            tally.first_mask_ms.append(first_ms)
            tally.answer_ms.append(first_ms)
            out, mask_us, bad = [], [], []
            for text, ids, valid in texts:
                m = grammar.matcher()
                accepted = True
                try:
                    for tid in ids:
                        if valid:
                            t2 = time.perf_counter()
                            m.fill_bitmask(bitmask, 0)
                            mask_us.append((time.perf_counter() - t2) * 1e6)
                        if not m.accept_tokens([tid]):
                            accepted = False
                            break
                    accepted = accepted and m.is_accepting()
                except RuntimeError:  # a lazy matcher past one of llguidance's limits
                    accepted = False
                out.append(accepted)
                tally.counts["valid_accepted" if valid else "invalid_accepted"] += accepted
                if accepted != valid:
                    bad.append({"valid": valid, "text": text[:300]})
            verdicts[b], masks[b] = out, mask_us
            tally.mask_us.extend(mask_us)
            if not bad:
                tally.counts["passed"] += 1
                if b == "lazy" and len(samples) < 256 and any(v for _, _, v in texts):
                    samples.append((grammar, next(ids for _, ids, v in texts if v)))
            else:
                kind = "fail:invalid_accepted" if any(not x["valid"] for x in bad) else "fail:valid_rejected"
                tally.reasons[kind] += 1
                fail_lines.append({"name": name, "backend": b, "reason": kind, "cases": bad[:3]})
            if program.regular and b == "lazy" and program.regex_size() < 1_000_000:
                pyre = re.compile(program.regex())
                for (text, _, _), accepted in zip(texts, out):
                    signal.setitimer(signal.ITIMER_REAL, 0.5)  # Python's re can backtrack exponentially
                    try:
                        regex_disagree += accepted != bool(pyre.fullmatch(text))
                    except _RegexTimeout:
                        regex_skipped += 1
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
        if "auto" in tallies:
            auto, lazy = tallies["auto"], tallies["lazy"]
            if verdicts.get("lazy") is None:
                auto.fail(lazy.reasons.most_common(1)[0][0] if lazy.reasons else "error:other", front_ms)
            else:
                auto.counts["compiled"] += 1
                auto.compile_ms.append(lazy.compile_ms[-1])
                auto.first_mask_ms.append(lazy.first_mask_ms[-1])
                auto.answer_ms.append(lazy.first_mask_ms[-1])
                ok = all(a == v for a, (_, _, v) in zip(verdicts["lazy"], texts))
                auto.counts["passed"] += ok
                auto.counts["valid_accepted"] += sum(a for a, (_, _, v) in zip(verdicts["lazy"], texts) if v)
                auto.counts["invalid_accepted"] += sum(a for a, (_, _, v) in zip(verdicts["lazy"], texts) if not v)
                if not ok:
                    auto.reasons["fail:invalid_accepted" if auto.counts["invalid_accepted"] else
                                 "fail:valid_rejected"] += 1
                steady = masks.get("eager") if verdicts.get("eager") is not None else None
                if steady is None:
                    # No eager index: a reused grammar stays on its lazy matcher, whose lexer
                    # states the earlier requests have built (matchers of one grammar share them).
                    steady = _warm_masks(lazy_grammar, texts, bitmask)
                    auto.counts["steady_lazy"] += 1
                else:
                    auto.counts["steady_eager"] += 1
                auto.mask_us.extend(steady)
    out = {"schemas": n_schemas, "whitespace": whitespace, "programs": dict(kinds),
           "backends": {b: t.report() for b, t in tallies.items()},
           "regex_disagreements": regex_disagree, "regex_checks_timed_out": regex_skipped,
           "check": "token-level: each backend's matcher on the instance's tokens, EOS at the end"}
    if "auto" in tallies:
        out["backends"]["auto"]["steady_state_eager"] = tallies["auto"].counts["steady_eager"]
        out["backends"]["auto"]["steady_state_lazy"] = tallies["auto"].counts["steady_lazy"]
    if step_share and samples:
        out["bitmask_step"] = bitmask_step_share(model_dir, samples, built)
    if failures_path is not None:
        failures_path.write_text("\n".join(json.dumps(x) for x in fail_lines) + "\n")
    return out


def bitmask_step_share(model_dir: Path, samples: list, backends: dict, rows: int = 32,
                       repeats: int = 20) -> dict:
    """Time filling a ``rows``-row bitmask (matchers mid-document) against one decode step of
    ``rows`` rows on the model; the share is mask / (step + mask). Matchers come from schemas that
    passed, each advanced halfway through one valid instance."""
    import random

    import torch

    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine
    from stencil.engine.request import SamplingParams
    from stencil.grammar.bitmask import allocate_bitmask

    rng = random.Random(0)
    picks = [samples[rng.randrange(len(samples))] for _ in range(rows)]
    matchers = []
    for grammar, ids in picks:
        m = grammar.matcher()
        m.accept_tokens(ids[:len(ids) // 2])
        matchers.append(m)
    vocab = next(iter(backends.values())).vocab
    bm = allocate_bitmask(rows, vocab.model_vocab_size)
    fill_ms = []
    for _ in range(repeats):
        for m in matchers:
            m._mask_valid = False  # time the mask, not its cache
        t0 = time.perf_counter()
        for r, m in enumerate(matchers):
            m.fill_bitmask(bm, r)
        fill_ms.append((time.perf_counter() - t0) * 1e3)
    engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=rows, speculative=None))
    try:
        tok = engine.tokenizer
        prompt = tok.encode("Write a long story about a lighthouse keeper.", add_special_tokens=False)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative={"method": "off"})
        for _ in range(rows):
            engine.add_request(None, prompt, params)
        step_ms = []
        while engine.has_unfinished():
            prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                or engine.scheduler.waiting
            t0 = time.perf_counter()
            engine.step()
            if not prefill and len(engine.scheduler.running) == rows:
                step_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        engine.grammar.close()
    mask = _percentile(fill_ms, 0.5)
    step = _percentile(step_ms, 0.5)
    return {"rows": rows, "bitmask_ms_p50": mask, "decode_step_ms_p50": step,
            "share_of_step": round(mask / (step + mask), 4) if step and mask is not None else None,
            "backend": "lazy (first sighting of each grammar)"}


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """Run as ``stencil bench conformance`` (parsed ``args``) or as a module (``argv`` list)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = set(backends) - {"eager", "lazy", "auto"}
    if unknown:
        print(f"unknown backends {sorted(unknown)}; choose from eager, lazy, auto", file=sys.stderr)
        return 2
    report = run_conformance(args.corpus, args.limit, args.timeout, args.mode, args.model,
                             args.failures, backends, args.whitespace, args.step_share)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
