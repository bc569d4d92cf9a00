"""``stencil bench spec``: n-gram + grammar drafts and forced tokens vs plain decoding, greedy.

``speedup`` compares decode tokens/s per request (tokens after the first over the time from the
first to the last token), since speculation changes decoding only; ``speedup_end_to_end``
divides output tokens by wall time, prefill included. Two workloads from
``stencil.benchmarks.workload``: "copy" (extraction: the answer's fields are spans of the document) and
"no_copy" (invent a person: nothing to copy). Each runs at concurrency 1 and 8 with speculation
and grammar-forced tokens on ("on") and with both off ("off"), on the same engine in the same
process, the same requests; the outputs are compared token by token (greedy decoding must not
change).

The sides are interleaved: each repeat is a *pair* run back to back, on then off in even
repeats, off then on in odd ones (on, off, off, on, ...), so a slow spell of a shared machine
lands on both sides of a repeat or splits between two, and a drift over the run cancels
between repeats. Every pair's ratio is reported, with the min / median / max over pairs.
A pair is only as good as the machine was steady: the plain steps of the off side (decode
steps at its most common batch size, median ms over each quarter of the run) are compared
quarter by quarter across all pairs of a workload and concurrency, and where they vary by more than
``NOISE_LIMIT`` (20%) the row is flagged *noisy* and printed as such, not as a result. Beside
the speedups stand the goodput switch's decisions in each "on" side: the share of steps that
drafted, its stops, trials and re-measurements, and the price of a draft row at the end
(``stencil.engine.speculative.goodput``).

Before the pairs, each workload runs once per side with at most 16 new tokens (``--no-warmup``
skips it): lazily built grammar states and the draft row's floor (``stencil.engine.speculative.row_cost``)
are then paid outside the measured runs. ``--repeat N`` runs N pairs; ``--background-load``
keeps one core busy with another process throughout (the engine's off-switch must hold up when
the machine is not its own).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from stencil.benchmarks.common import run_closed_loop, summarize

# A separate interpreter spinning on one core (no I/O, nothing to clean up but the process).
_BUSY_LOOP = "while True: pass"
#: Plain steps varying by more than this (max / min - 1 of one quarter's medians across the pairs)
#: make a row noisy.
NOISE_LIMIT = 0.20
SEGMENTS = 4  # parts of a run whose plain steps are compared
WARMUP_TOKENS = 16


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
    p.add_argument("--repeat", type=int, default=1,
                   help="pairs (on and off back to back, the order alternating) per workload and concurrency")
    p.add_argument("--background-load", action="store_true",
                   help="keep one core busy with another process while the benchmark runs")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help=f"run each workload once per side ({WARMUP_TOKENS} tokens) before the pairs")


def run_mode(engine, prompts, grammars, concurrency: int, max_tokens: int, on: bool, spec: dict) -> dict:
    from stencil.engine.request import SamplingParams

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
    rows, decode_steps = [0], []  # (requests, ms) of each decode-only step, in order

    def marked_schedule():
        out = schedule()
        prefill[0] = any(sr.request.num_computed_tokens < sr.request.num_prompt_tokens for sr in out.scheduled)
        rows[0] = len(out.scheduled)
        return out

    def timed_step():
        t = time.perf_counter()
        outs = step()
        if not prefill[0]:
            dt = time.perf_counter() - t
            decode_only[0] += dt
            decode_only[1] += sum(len(o.new_token_ids) for o in outs)
            decode_only[2] += 1
            decode_steps.append((rows[0], dt * 1e3))
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
                    "row_floor_ms": goodput["row_floor_ms"],
                    "stops": goodput["stops"] - goodput0["stops"], "trials": goodput["trials"] - goodput0["trials"],
                    "remeasures": goodput["remeasures"] - goodput0["remeasures"]},
        # The plain-step clock of this run: its most common batch size and, per quarter of its
        # decode steps at that size, their median ms (read on the off side).
        **segment_medians(decode_steps),
        "step_ms": wall * 1e3 / max(steps, 1),
        "steps_per_token": steps / max(s["output_tokens"], 1),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": sum(t.verify_steps for t in traces),
        "forced_tokens": sum(t.forced_tokens for t in traces),
        "token_ids": [t.token_ids for t in traces],
    })
    return s


def segment_medians(steps: list[tuple[int, float]], segments: int = SEGMENTS) -> dict:
    """``{"plain_batch": requests, "plain_segments_ms": [median ms, ...]}`` of the decode steps
    ``(requests, ms)`` at their most common batch size, in ``segments`` consecutive parts (fewer
    where there are under 2 steps a part; none without steps)."""
    if not steps:
        return {"plain_batch": None, "plain_segments_ms": []}
    batch = Counter(n for n, _ in steps).most_common(1)[0][0]
    ms = [t for n, t in steps if n == batch]
    parts = max(1, min(segments, len(ms) // 2))
    bounds = [round(i * len(ms) / parts) for i in range(parts + 1)]
    return {"plain_batch": batch,
            "plain_segments_ms": [statistics.median(ms[a:b]) for a, b in zip(bounds, bounds[1:])]}


def plain_variation(pairs: list[dict]) -> float | None:
    """How much the plain steps of the off sides varied over ``pairs`` (rows of ``compare``):
    for each quarter of the run, its largest median over its smallest across the pairs, less 1;
    the largest of those. Every pair runs the same requests, so a quarter's steps are alike in
    each pair on a steady machine, while the quarters of one run may differ by design (a context
    that grows, requests that end): comparing across quarters read that as noise (issue 35's
    no_copy at 8 requests: quarters of 19 and 23 ms in every pair). With one pair, its quarters
    are compared with each other. None with fewer than 2 medians."""
    rows = [r["plain_segments_ms_off"] for r in pairs if r["plain_segments_ms_off"]]
    if len(rows) < 2:
        values = [m for r in rows for m in r]
        return max(values) / min(values) - 1.0 if len(values) >= 2 and min(values) > 0 else None
    ratios = []
    for q in range(max(map(len, rows))):
        values = [r[q] for r in rows if q < len(r)]
        if len(values) >= 2 and min(values) > 0:
            ratios.append(max(values) / min(values) - 1.0)
    return max(ratios) if ratios else None


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
        "plain_batch_off": off["plain_batch"],
        "plain_segments_ms_off": off["plain_segments_ms"],
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


def _min_median_max(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else None


def spread(pairs: list[dict]) -> dict:
    """One row of the summary, over ``pairs`` (rows of ``compare``, in run order): min / median
    / max of each speedup, whether every output was identical, how much the plain steps varied
    and whether that makes the row noisy, and the goodput switch's decisions in the "on" sides."""
    out: dict = {}
    for key in ("speedup", "speedup_end_to_end", "decode_only_speedup"):
        r = _min_median_max([p[key] for p in pairs])
        if r is not None:
            out[key] = r
    out["identical"] = all(p["identical"] for p in pairs)
    variation = plain_variation(pairs)
    out["plain_step_variation"] = variation
    out["noisy"] = variation is not None and variation > NOISE_LIMIT
    out["switch"] = {
        "drafting_share": _min_median_max([p["drafting_share"] for p in pairs]),
        "stops": [p["goodput"]["stops"] for p in pairs],
        "trials": [p["goodput"]["trials"] for p in pairs],
        "remeasures": [p["goodput"]["remeasures"] for p in pairs],
        "draft_row_ms": _min_median_max([p["goodput"]["draft_row_ms_at_end"] for p in pairs]),
        "gain": _min_median_max([p["goodput"]["gain_at_end"] for p in pairs]),
    }
    out["pairs"] = pairs
    return out


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` gives it (from /proc/cpuinfo), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _start_background_load() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from stencil.benchmarks.workload import extraction_items, invention_items
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine
    from stencil.engine.models.default_model import ensure_default_model
    from stencil.grammar.base import GrammarSpec

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
    report: dict = {"model": str(model), "cpu": cpu_model(), "max_tokens": args.max_tokens, "speculative": spec,
                    "requests": args.requests, "threads": args.threads, "repeat": args.repeat,
                    "background_load": args.background_load, "noise_limit": NOISE_LIMIT,
                    "order": "pairs back to back; on, off in even repeats, off, on in odd ones"}
    pairs: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in names for c in concurrencies}
    load = _start_background_load() if args.background_load else None
    try:
        if args.warmup:
            for prompts, grammars in workloads.values():
                for on in (True, False):
                    run_mode(engine, prompts, grammars, max(concurrencies), min(WARMUP_TOKENS, args.max_tokens),
                             on, spec)
        for rep in range(args.repeat):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for name, (prompts, grammars) in workloads.items():
                for c in concurrencies:
                    side = {on: run_mode(engine, prompts, grammars, c, args.max_tokens, on, spec) for on in order}
                    row = {"repeat": rep + 1, "order": "on,off" if order[0] else "off,on",
                           **compare(side[True], side[False])}
                    pairs[(name, c)].append(row)
                    _print_pair(name, c, row, args.repeat)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    report["row_floor_ms"] = engine.goodput.row_floor_ms
    for name in names:
        report[name] = {str(c): spread(pairs[(name, c)]) for c in concurrencies}
    report["noisy"] = any(report[n][str(c)]["noisy"] for n in names for c in concurrencies)
    _print_summary(report, names, concurrencies)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


def _print_pair(name: str, c: int, row: dict, repeat: int) -> None:
    g = row["goodput"]
    segments = " ".join(f"{m:.1f}" for m in row["plain_segments_ms_off"])
    print(f"[spec] pair {row['repeat']}/{repeat} ({row['order']}) {name} c={c}: speedup {row['speedup']:.2f}x "
          f"(end-to-end {row['speedup_end_to_end']:.2f}x), acceptance {row['acceptance_rate']:.2f}, "
          f"drafting {row['drafting_share']:.2f} of steps (stops {g['stops']}, trials {g['trials']}, "
          f"re-measured {g['remeasures']}, draft row {_ms(g['draft_row_ms_at_end'])} ms), steps/token "
          f"{row['steps_per_token_on']:.2f} vs {row['steps_per_token_off']:.2f}, plain steps (ms, by quarter) "
          f"{segments}, identical {row['identical']}", flush=True)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _print_summary(report: dict, names: list[str], concurrencies: list[int]) -> None:
    print(f"[spec] {report['cpu']}; {report['order']}; a row is noisy where the plain steps varied by more "
          f"than {report['noise_limit']:.0%}")
    print("[spec] workload  c  speedup min / median / max  end-to-end min / median / max  drafting share  "
          "stops  trials  draft row ms  plain varied  identical")
    for name in names:
        for c in concurrencies:
            r = report[name][str(c)]
            s, e, sw = r["speedup"], r["speedup_end_to_end"], r["switch"]
            d, price = sw["drafting_share"], sw["draft_row_ms"]
            varied = "-" if r["plain_step_variation"] is None else f"{r['plain_step_variation']:.0%}"
            speed = (f"noisy, not a result ({s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f})" if r["noisy"]
                     else f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}")
            print(f"[spec] {name:8s} {c:2d}  {speed}  {e['min']:.2f} / {e['median']:.2f} / {e['max']:.2f}  "
                  f"{d['min']:.2f}-{d['max']:.2f}  {sum(sw['stops'])}  {sum(sw['trials'])}  "
                  f"{_ms(price['median'] if price else None)}  {varied}  {r['identical']}")
    if report["noisy"]:
        print("[spec] NOISY: the machine's speed varied during the run; rerun on an idle machine before "
              "quoting these figures")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
