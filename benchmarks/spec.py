"""``stencil bench spec``: n-gram + grammar drafts and forced tokens vs plain decoding, greedy.

``speedup`` compares decode tokens/s per request (tokens after the first over the time from the
first to the last token), since speculation changes decoding only; ``speedup_end_to_end``
divides output tokens by wall time, prefill included. Two workloads from
``benchmarks.workload``: "copy" (extraction: the answer's fields are spans of the document) and
"no_copy" (invent a person: nothing to copy). Each runs at concurrency 1 and 8 with speculation
and grammar-forced tokens on, then with both off, on the same engine in the same process; the
outputs are compared token by token (greedy decoding must not change).

``--repeat N`` runs the whole comparison N times in a row and reports the min / median / max
of each speedup; ``--background-load`` keeps one core busy with another process throughout
(the engine's off-switch must hold up when the machine is not its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import run_closed_loop, summarize

# A separate interpreter spinning on one core (no I/O, nothing to clean up but the process).
_BUSY_LOOP = "while True: pass"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=16, help="requests per workload and concurrency")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--workloads", default="copy,no_copy", help="comma-separated: copy, no_copy")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for Stencil and the baseline alike (default: torch's own)")
    p.add_argument("--weights", default=None, help="fp32 or int4 (default: engine default)")
    p.add_argument("--repeat", type=int, default=1, help="run everything this many times; report min/median/max")
    p.add_argument("--background-load", action="store_true",
                   help="keep one core busy with another process while the benchmark runs")


def run_mode(engine, prompts, grammars, concurrency: int, max_tokens: int, on: bool, spec: dict) -> dict:
    from engine.request import SamplingParams

    engine.scheduler.enable_forced_tokens = on
    engine.kv.set_prefix_caching(True)  # same (empty) cache state for both modes
    # Cut at max_tokens (no budget closing): this measures speculation, and a tiny --max-tokens
    # must not be refused as below a schema's shortest answer.
    params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=spec if on else {"method": "off"},
                            close_on_budget=False)
    steps0 = engine.num_steps
    goodput0 = engine.goodput.stats()
    # Time spent proposing drafts (n-gram and text lookup, grammar trimming), against the step.
    propose, spent, drafting = engine.drafter.propose, [0.0], [0]

    def timed(requests, budget):
        t = time.perf_counter()
        out = propose(requests, budget)
        spent[0] += time.perf_counter() - t
        drafting[0] += 1
        return out

    # Steps that read no prompt tokens ("decode-only"): where speculation can act at all.
    schedule, step, decode_only, prefill = engine.scheduler.schedule, engine.step, [0.0, 0, 0], [False]

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
            decode_only[2] += 1
        return outs

    engine.drafter.propose = timed
    engine.scheduler.schedule, engine.step = marked_schedule, timed_step
    try:
        traces, wall = run_closed_loop(engine, prompts, params, grammars, concurrency)
    finally:
        del engine.drafter.propose, engine.step, engine.scheduler.schedule  # back to the class's methods
    steps = engine.num_steps - steps0
    s = summarize(traces, wall, [])
    # Decode rate: tokens after the first over the time from first to last token, summed over
    # requests. Speculation acts on decoding only; prefill time (the same in both modes)
    # would dilute the comparison.
    span = sum(t.token_times[-1] - t.token_times[0] for t in traces if len(t.token_times) > 1)
    s["decode_tokens_per_s"] = sum(len(t.token_times) - 1 for t in traces) / span if span else None
    drafted = sum(t.draft_tokens for t in traces)
    accepted = sum(t.accepted_tokens for t in traces)
    goodput = engine.goodput.stats()
    s.update({
        "steps": steps,
        # Output tokens (sampled, accepted and forced) per second of decode-only steps.
        "decode_only_tokens_per_s": decode_only[1] / decode_only[0] if decode_only[0] else None,
        "decode_only_time_share": decode_only[0] / wall,
        "propose_ms_per_step": spent[0] * 1e3 / max(steps, 1),
        # Steps after which the proposers ran (the rest: probes, or drafting switched off).
        "drafting_steps": drafting[0],
        "goodput": {"gain_at_end": goodput["gain"], "draft_row_ms_at_end": goodput["draft_row_ms"],
                    "stops": goodput["stops"] - goodput0["stops"], "trials": goodput["trials"] - goodput0["trials"]},
        "step_ms": wall * 1e3 / max(steps, 1),
        "steps_per_token": steps / max(s["output_tokens"], 1),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": sum(t.verify_steps for t in traces),
        "forced_tokens": sum(t.forced_tokens for t in traces),
        "token_ids": [t.token_ids for t in traces],
    })
    return s


def compare(on: dict, off: dict) -> dict:
    """One row of the report: speculation and forced tokens on against both off."""
    n_mismatch = sum(a != b for a, b in zip(on["token_ids"], off["token_ids"]))
    return {
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
        "drafting_share": on["drafting_steps"] / max(on["steps"], 1),
        "goodput": on["goodput"],
        "steps_per_token_on": on["steps_per_token"],
        "propose_ms_per_step": on["propose_ms_per_step"],
        "decode_only_speedup": (on["decode_only_tokens_per_s"] / off["decode_only_tokens_per_s"]
                                if on["decode_only_tokens_per_s"] and off["decode_only_tokens_per_s"] else None),
        "decode_only_time_share_off": off["decode_only_time_share"],
        "step_ms_on": on["step_ms"],
        "step_ms_off": off["step_ms"],
        "steps_per_token_off": off["steps_per_token"],
        "output_tokens": on["output_tokens"],
        "identical": on["token_ids"] == off["token_ids"],
        "mismatched_requests": n_mismatch,
    }


def spread(runs: list[dict]) -> dict:
    """Min / median / max of each speedup over ``runs`` (rows of ``compare``), and whether
    every run's outputs were identical."""
    out: dict = {}
    for key in ("speedup", "speedup_end_to_end", "decode_only_speedup"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    out["identical"] = all(r["identical"] for r in runs)
    out["runs"] = runs
    return out


def _start_background_load() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
    makers = {"copy": extraction_items, "no_copy": invention_items}
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(makers))
    if unknown:
        print(f"stencil bench spec: unknown workload(s) {unknown}; known: {sorted(makers)}", file=sys.stderr)
        return 2
    workloads = {}
    for name in names:
        items = makers[name](args.requests, seed=3)
        prompts = [tok.encode(tok.apply_chat_template(it.messages(), add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False) for it in items]
        workloads[name] = (prompts, [engine.grammar.compile(GrammarSpec.json_schema(it.schema)) for it in items])
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    report: dict = {"model": str(model), "max_tokens": args.max_tokens, "speculative": spec,
                    "requests": args.requests, "threads": args.threads, "repeat": args.repeat,
                    "background_load": args.background_load}
    runs: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in names for c in concurrencies}
    load = _start_background_load() if args.background_load else None
    try:
        for rep in range(args.repeat):
            for name, (prompts, grammars) in workloads.items():
                for c in concurrencies:
                    off = run_mode(engine, prompts, grammars, c, args.max_tokens, False, spec)
                    on = run_mode(engine, prompts, grammars, c, args.max_tokens, True, spec)
                    row = compare(on, off)
                    runs[(name, c)].append(row)
                    print(f"[spec] run {rep + 1}/{args.repeat} {name} c={c}: speedup {row['speedup']:.2f}x "
                          f"(end-to-end {row['speedup_end_to_end']:.2f}x), acceptance {row['acceptance_rate']:.2f}, "
                          f"drafting {row['drafting_share']:.2f} of steps, steps/token "
                          f"{row['steps_per_token_on']:.2f} vs {row['steps_per_token_off']:.2f}, "
                          f"identical {row['identical']}", flush=True)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    for name in names:
        report[name] = {str(c): spread(runs[(name, c)]) for c in concurrencies}
    print("[spec] workload  c  speedup min / median / max   end-to-end min / median / max   identical")
    for name in names:
        for c in concurrencies:
            r = report[name][str(c)]
            s, e = r["speedup"], r["speedup_end_to_end"]
            print(f"[spec] {name:8s} {c:2d}  {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}"
                  f"            {e['min']:.2f} / {e['median']:.2f} / {e['max']:.2f}            {r['identical']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
