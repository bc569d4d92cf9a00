"""``stencil bench budget``: structured answers under tight ``max_tokens``, closed in time or not.

Requests: the throughput workload's extraction items (``stencil.benchmarks.workload``), plus small schemas
from a MaskBench corpus (``--corpus``) asked for an example document. Each runs first unbudgeted
(``close_on_budget`` off, a generous ``max_tokens``) to get its natural length ``L``; then at
``max_tokens`` = 25%, 50%, 100% and 150% of ``L`` with budget-aware masks on, greedy, batched.

Per budget fraction: ``admitted`` (the rest got the admission 400: below the grammar's shortest
output), ``valid_fraction`` (jsonschema, format checker on; must be 1.0), ``finished_length``
(must be 0), ``closed_by_budget``, ``guard_hits`` (the run-on guard bound), and ``leaf_identity``:
the share of the unbudgeted output's leaf values (JSON pointer → value) that the budgeted output
has identical. ``mask_ms`` times ``BudgetMatcher.fill_bitmask`` per row, for rows near their
budget (narrowing computed) and far from it (the backend's mask only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

FRACTIONS = (0.25, 0.5, 1.0, 1.5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=12, help="extraction items from the workload")
    p.add_argument("--corpus", type=Path, default=None, help="MaskBench-format schemas to add")
    p.add_argument("--corpus-schemas", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256, help="the unbudgeted run's limit")
    p.add_argument("--threads", type=int, default=None)


def _leaves(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}/{k}"))
        return out or {prefix: {}}
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(_leaves(v, f"{prefix}/{i}"))
        return out or {prefix: []}
    return {prefix: value}


def _corpus_items(corpus: Path, n: int):
    """Small schemas with at least one object property, evenly spread over the corpus."""
    files = sorted(corpus.glob("*.json"))
    out = []
    for f in files[:: max(1, len(files) // (8 * n))]:
        schema = json.loads(f.read_text())["schema"]
        text = json.dumps(schema)
        if len(text) > 2000 or not isinstance(schema, dict) or "properties" not in text:
            continue
        out.append((f.stem, schema))
        if len(out) >= n:
            break
    return out


def main(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from stencil.benchmarks.common import is_valid, make_validator
    from stencil.benchmarks.workload import extraction_items
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import EngineError, LLMEngine
    from stencil.engine.models.default_model import ensure_default_model
    from stencil.engine.request import SamplingParams
    from stencil.grammar.base import GrammarError, GrammarSpec
    from stencil.grammar.budget import BudgetMatcher

    model = args.model or ensure_default_model()
    engine = LLMEngine(EngineConfig(model=model, kv_cache_gib=1.0, max_num_seqs=8))
    tok = engine.tokenizer

    def chat(messages):
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)

    cases = []  # (name, prompt ids, schema, grammar)
    for i, it in enumerate(extraction_items(args.requests, seed=11)):
        cases.append((f"workload/{it.kind}/{i}", chat(it.messages()), it.schema))
    if args.corpus is not None:
        for name, schema in _corpus_items(args.corpus, args.corpus_schemas):
            msg = [{"role": "user", "content": "Write one example JSON document for this schema:\n"
                                               + json.dumps(schema)[:1500]}]
            cases.append((f"corpus/{name}", chat(msg), schema))
    compiled = []
    for name, prompt, schema in cases:
        try:
            g = engine.grammar.compile(GrammarSpec.json_schema(schema))
            g.closing().result()
        except Exception as e:  # noqa: BLE001 - refused or not modelled: listed, not run
            print(f"[budget] skip {name}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        compiled.append((name, prompt, schema, g))

    # Time the budget matcher's masks, split by whether the row was near its budget.
    timings = {"near": [], "far": []}
    original = BudgetMatcher.fill_bitmask

    def timed(self, bitmask, row):
        a = self._ready(wait=False)
        near = a is not None and not self.disabled and self._near(a)
        t0 = time.perf_counter()
        original(self, bitmask, row)
        timings["near" if near else "far"].append((time.perf_counter() - t0) * 1e3)

    BudgetMatcher.fill_bitmask = timed
    try:
        free = engine.generate([c[1] for c in compiled],
                               SamplingParams(max_tokens=args.max_tokens, temperature=0, close_on_budget=False),
                               [c[3] for c in compiled])
        report: dict = {"model": str(model), "requests": len(compiled), "fractions": {}}
        for frac in FRACTIONS:
            rows = []
            for (name, prompt, schema, g), base in zip(compiled, free):
                budget = max(1, round(frac * len(base["token_ids"])))
                try:
                    engine.check_budget(g, SamplingParams(max_tokens=budget))
                except EngineError:
                    rows.append({"name": name, "admitted": False})
                    continue
                rows.append({"name": name, "admitted": True, "budget": budget, "grammar": g, "prompt": prompt,
                             "schema": schema, "base": base})
            admitted = [r for r in rows if r["admitted"]]
            outs = engine.generate([r["prompt"] for r in admitted],
                                   [SamplingParams(max_tokens=r["budget"], temperature=0) for r in admitted],
                                   [r["grammar"] for r in admitted])
            valid = length = closed = guard = 0
            same = total = 0
            for r, out in zip(admitted, outs):
                ok = is_valid(out["text"], make_validator(r["schema"]))
                valid += ok
                length += out["finish_reason"] == "length"
                closed += bool(out["output"].closed_by_budget)
                guard += bool(out["output"].guard_hits)
                try:
                    want = _leaves(json.loads(r["base"]["text"]))
                    got = _leaves(json.loads(out["text"]))
                    total += len(want)
                    same += sum(1 for k, v in want.items() if k in got and got[k] == v)
                except ValueError:
                    pass
            entry = {"admitted": len(admitted), "refused_below_minimum": len(rows) - len(admitted),
                     "valid_fraction": valid / len(admitted) if admitted else None,
                     "finished_length": length, "closed_by_budget": closed, "guard_hits": guard,
                     "leaf_identity": same / total if total else None}
            report["fractions"][str(frac)] = entry
            print(f"[budget] {frac:.0%} of the natural length: {entry}", flush=True)
        base_valid = sum(is_valid(b["text"], make_validator(c[2])) for c, b in zip(compiled, free))
        report["unbudgeted"] = {"valid_fraction": base_valid / len(compiled) if compiled else None,
                                "mean_tokens": sum(len(b["token_ids"]) for b in free) / max(1, len(free))}
    finally:
        BudgetMatcher.fill_bitmask = original
        engine.grammar.close()
    for k, xs in timings.items():
        xs.sort()
        report[f"mask_ms_{k}"] = {"rows": len(xs), "p50": xs[len(xs) // 2] if xs else None,
                                  "p99": xs[int(0.99 * (len(xs) - 1))] if xs else None,
                                  "mean": sum(xs) / len(xs) if xs else None}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
