"""``stencil bench weights``: fp32 vs int4 (GGUF 4-bit blocks as they are) weights, speed and quality.

One run, one machine, both weight kinds loaded side by side (the ratios are what matters on a
noisy box):

* decode tokens/s at each concurrency ``C`` for fp32 and int4: ``C`` requests (extraction
  prompts from ``stencil.benchmarks.workload``, greedy, ``ignore_eos``) start together and each decodes
  ``--max-tokens`` tokens; the rate counts the tokens after every request's first, over the
  time from the last first token to the end, so prefill is left out;
* constrained decode at concurrency 1 (JSON Schema of each item, compiled by the engine's
  grammar compiler): tokens after the first over the time from first to last token, summed
  over the requests run one after another; every output checked with jsonschema;
* greedy agreement: the same ``--agreement-prompts`` prompts, unconstrained greedy, int4 vs
  fp32: the fraction of prompts whose outputs are identical (plus the mean fraction of the
  fp32 output that int4 reproduces before diverging).

Report keys: ``{"fp32": {"1": tok_s, "8": ..., "32": ...}, "int4": {...},
"int4_constrained_c1": tok_s, "greedy_agreement": fraction}`` plus details.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from stencil.benchmarks.common import is_valid, make_validator, run_closed_loop


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--gguf", type=Path, default=None, help="its GGUF file (default: found by the loader)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=48, help="decoded tokens per request")
    p.add_argument("--constrained-requests", type=int, default=6, help="constrained requests at C=1")
    p.add_argument("--agreement-prompts", type=int, default=20)
    p.add_argument("--agreement-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def _engine(model: Path, weights: str, gguf: Path | None, threads: int | None):
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine

    extra = {"gguf_file": str(gguf)} if gguf else {}
    return LLMEngine(EngineConfig(model=model, weights=weights, kv_cache_gib=0.5, max_num_seqs=64,
                                  num_threads=threads, extra=extra))


def _prompt_ids(tokenizer, items) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(it.messages(), add_generation_prompt=True, tokenize=False)
             for it in items]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def decode_rate(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s of ``len(prompts)`` requests started together (prefill left out)."""
    from stencil.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    traces, _ = run_closed_loop(engine, prompts, params, None, len(prompts))
    start = max(t.token_times[0] for t in traces)
    end = max(t.token_times[-1] for t in traces)
    tokens = sum(sum(1 for x in t.token_times if x > start) for t in traces)
    return tokens / (end - start)


def constrained_c1(engine, items, prompts: list[list[int]], max_tokens: int) -> dict:
    """Constrained requests one at a time: decode tokens/s and how many outputs are valid."""
    from stencil.engine.request import SamplingParams
    from stencil.grammar.base import GrammarSpec

    grammars = [engine.grammar.compile(GrammarSpec.json_schema(it.schema)) for it in items]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    traces, _ = run_closed_loop(engine, prompts, params, grammars, 1)
    tokens = sum(len(t.token_times) - 1 for t in traces)
    span = sum(t.token_times[-1] - t.token_times[0] for t in traces)
    valid = [is_valid(t.text, make_validator(it.schema)) for t, it in zip(traces, items)]
    return {"tok_s": tokens / span, "tokens": tokens, "steps": sum(t.steps for t in traces),
            "valid": sum(valid), "requests": len(valid),
            "finish_reasons": sorted({t.finish_reason for t in traces})}


def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from stencil.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    traces, _ = run_closed_loop(engine, prompts, params, None, 8)
    return [t.token_ids for t in traces]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of identical outputs, mean fraction of ``a`` matched before the first difference)."""
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return same, sum(prefix) / len(prefix)


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.workload import extraction_items
    from stencil.engine.models.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    levels = [int(c) for c in args.concurrency.split(",")]
    report: dict = {"model": str(model), "max_tokens": args.max_tokens}
    engines = {}
    for kind in ("fp32", "int4"):
        t0 = time.perf_counter()
        engines[kind] = _engine(model, kind, args.gguf, args.threads)
        report[f"{kind}_load_s"] = round(time.perf_counter() - t0, 2)
    tok = engines["fp32"].tokenizer
    items = extraction_items(max(levels + [args.agreement_prompts, args.constrained_requests]), seed=3)
    prompts = _prompt_ids(tok, items)
    for kind in ("fp32", "int4"):
        report[kind] = {}
    # Interleave the kinds per level so a burst of load on a shared machine hits both alike.
    for c in levels:
        for kind, eng in engines.items():
            decode_rate(eng, prompts[:1], 4)  # warm-up of this engine's kernels
            report[kind][str(c)] = round(decode_rate(eng, prompts[:c], args.max_tokens), 2)
            print(f"{kind} C={c}: {report[kind][str(c)]} tok/s", flush=True)
    n = args.constrained_requests
    for kind, eng in engines.items():
        res = constrained_c1(eng, items[:n], prompts[:n], 256)
        report[f"{kind}_constrained_c1_detail"] = res
        report[f"{kind}_constrained_c1"] = round(res["tok_s"], 2)
        print(f"{kind} constrained C=1: {res['tok_s']:.1f} tok/s, {res['valid']}/{res['requests']} valid",
              flush=True)
    k = args.agreement_prompts
    outs = {kind: greedy_outputs(eng, prompts[:k], args.agreement_tokens) for kind, eng in engines.items()}
    same, prefix = agreement(outs["fp32"], outs["int4"])
    report["greedy_agreement"] = same
    report["greedy_prefix_agreement"] = round(prefix, 4)
    print(f"greedy agreement int4 vs fp32: {same:.2f} identical, {prefix:.2f} mean matched prefix",
          flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0
