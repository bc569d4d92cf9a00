"""``stencil bench spec``: n-gram + grammar drafts and forced tokens vs plain decoding, greedy.

``speedup`` compares decode tokens/s per request (tokens after the first over the time from the
first to the last token), since speculation changes decoding only; ``speedup_end_to_end``
divides output tokens by wall time, prefill included. Two workloads from ``benchmarks.workload``: "copy" (extraction: the answer's fields are spans of
the document) and "no_copy" (invent a person: nothing to copy). Each runs at concurrency 1 and
8 with speculation and grammar-forced tokens on, then with both off, on the same engine in the
same process; the outputs are compared token by token (greedy decoding must not change).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import run_closed_loop, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=16, help="requests per workload and concurrency")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for Stencil and the baseline alike (default: torch's own)")
    p.add_argument("--weights", default=None, help="fp32 or int4 (default: engine default)")


def run_mode(engine, prompts, grammars, concurrency: int, max_tokens: int, on: bool, spec: dict) -> dict:
    from engine.request import SamplingParams

    engine.scheduler.enable_forced_tokens = on
    engine.kv.set_prefix_caching(True)  # same (empty) cache state for both modes
    params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=spec if on else {"method": "off"})
    steps0 = engine.num_steps
    # Time spent proposing drafts (n-gram and text lookup, grammar trimming), against the step.
    propose, spent = engine._propose_drafts, [0.0]

    def timed() -> None:
        t = time.perf_counter()
        propose()
        spent[0] += time.perf_counter() - t

    # Steps that read no prompt tokens ("decode-only"): where speculation can act at all.
    schedule, step, decode_only, prefill = engine.scheduler.schedule, engine.step, [0.0, 0], [False]

    def marked_schedule():
        out = schedule()
        prefill[0] = any(sr.request.num_computed_tokens < sr.request.num_prompt_tokens for sr in out.scheduled)
        return out

    def timed_step():
        t = time.perf_counter()
        outs = step()
        if not prefill[0]:
            decode_only[0] += time.perf_counter() - t
            decode_only[1] += sum(len(o.new_token_ids) for o in outs)
        return outs

    engine._propose_drafts = timed
    engine.scheduler.schedule, engine.step = marked_schedule, timed_step
    try:
        traces, wall = run_closed_loop(engine, prompts, params, grammars, concurrency)
    finally:
        del engine._propose_drafts, engine.step, engine.scheduler.schedule  # back to the class's methods
    steps = engine.num_steps - steps0
    s = summarize(traces, wall, [])
    # Decode rate: tokens after the first over the time from first to last token, summed over
    # requests. Speculation acts on decoding only; prefill time (the same in both modes)
    # would dilute the comparison.
    span = sum(t.token_times[-1] - t.token_times[0] for t in traces if len(t.token_times) > 1)
    s["decode_tokens_per_s"] = sum(len(t.token_times) - 1 for t in traces) / span if span else None
    drafted = sum(t.draft_tokens for t in traces)
    accepted = sum(t.accepted_tokens for t in traces)
    s.update({
        "steps": steps,
        # Output tokens (sampled, accepted and forced) per second of decode-only steps.
        "decode_only_tokens_per_s": decode_only[1] / decode_only[0] if decode_only[0] else None,
        "decode_only_time_share": decode_only[0] / wall,
        "propose_ms_per_step": spent[0] * 1e3 / max(steps, 1),
        "step_ms": wall * 1e3 / max(steps, 1),
        "steps_per_token": steps / max(s["output_tokens"], 1),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": sum(t.verify_steps for t in traces),
        "forced_tokens": sum(t.forced_tokens for t in traces),
        "token_ids": [t.token_ids for t in traces],
    })
    return s


def main(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from benchmarks.workload import extraction_items, invention_items
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.default_model import ensure_default_model
    from grammar.base import GrammarSpec

    model = args.model or ensure_default_model()
    kw = {"weights": args.weights} if args.weights else {}
    engine = LLMEngine(EngineConfig(model=model, kv_cache_gib=1.0, **kw))
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 5, "max_batch_size": 64}
    tok = engine.tokenizer
    report: dict = {"model": str(model), "max_tokens": args.max_tokens, "speculative": spec}
    for name, items in (("copy", extraction_items(args.requests, seed=3)),
                        ("no_copy", invention_items(args.requests, seed=3))):
        prompts = [tok.encode(tok.apply_chat_template(it.messages(), add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False) for it in items]
        grammars = [engine.grammar.compile(GrammarSpec.json_schema(it.schema)) for it in items]
        report[name] = {}
        for c in [int(x) for x in args.concurrency.split(",")]:
            off = run_mode(engine, prompts, grammars, c, args.max_tokens, False, spec)
            on = run_mode(engine, prompts, grammars, c, args.max_tokens, True, spec)
            identical = on["token_ids"] == off["token_ids"]
            n_mismatch = sum(a != b for a, b in zip(on["token_ids"], off["token_ids"]))
            row = {
                "speedup": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                "speedup_end_to_end": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                "decode_tokens_per_s_on": on["decode_tokens_per_s"],
                "decode_tokens_per_s_off": off["decode_tokens_per_s"],
                "output_tokens_per_s_on": on["output_tokens_per_s"],
                "output_tokens_per_s_off": off["output_tokens_per_s"],
                "acceptance_rate": on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0,
                # Draft tokens accepted per verification step (the bonus token not counted).
                "mean_accepted_length": on["accepted_tokens"] / on["verify_steps"] if on["verify_steps"] else 0.0,
                "draft_tokens": on["draft_tokens"],
                "accepted_tokens": on["accepted_tokens"],
                "forced_tokens": on["forced_tokens"],
                "steps_per_token_on": on["steps_per_token"],
                "propose_ms_per_step": on["propose_ms_per_step"],
                "decode_only_speedup": (on["decode_only_tokens_per_s"] / off["decode_only_tokens_per_s"]
                                        if on["decode_only_tokens_per_s"] and off["decode_only_tokens_per_s"] else None),
                "decode_only_time_share_off": off["decode_only_time_share"],
                "step_ms_on": on["step_ms"],
                "step_ms_off": off["step_ms"],
                "steps_per_token_off": off["steps_per_token"],
                "output_tokens": on["output_tokens"],
                "identical": identical,
                "mismatched_requests": n_mismatch,
            }
            report[name][str(c)] = row
            print(f"[spec] {name} c={c}: speedup {row['speedup']:.2f}x, acceptance {row['acceptance_rate']:.2f}, "
                  f"steps/token {row['steps_per_token_on']:.2f} vs {row['steps_per_token_off']:.2f}, "
                  f"identical {identical}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
