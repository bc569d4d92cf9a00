"""``stencil bench throughput``: structured extraction through Stencil vs outlines + transformers.

Scenarios (one run, one machine, so the ratios are meaningful on a noisy box):

1. throughput: the same extraction workload (``stencil.benchmarks.workload``: documents of 150-400
   tokens, a JSON Schema each, greedy) at each concurrency, through Stencil's engine in process
   (closed loop: ``C`` requests in flight) and through the baseline a user would pick here, the
   ``outlines`` library driving transformers' ``generate`` on the same fp32 weights, batched ``C``
   requests at a time (requests of one schema per batch: the kindest grouping for it).
2. prefix_cache: requests sharing a ~1,000-token system prompt, one at a time; TTFT p50 with
   the prefix cache on vs off.
3. chunked_prefill: a 4,000-token prompt arrives while 16 requests decode; their ITL p99 while it
   is read, with chunked prefill (``--chunk`` tokens a step) vs without (the whole prompt in one step).

ITL counts every output token: a gap between two outputs is split evenly over the tokens that
arrived together. TTFT is measured from the moment a request enters the engine (Stencil) or its
batch starts (baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from stencil.benchmarks.common import Trace, is_valid, make_validator, pct, run_closed_loop, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default: next to --json)")
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--scenarios", default="throughput,prefix_cache,chunked_prefill")
    p.add_argument("--no-baseline", action="store_true", help="skip outlines (Stencil only)")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk (tokens) in the chunked scenario")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for Stencil and the baseline alike (default: torch's own)")
    p.add_argument("--weights", default=None, help="Stencil weights: fp32 or int4 (default: engine default)")
    p.add_argument("--prompt-weights", default=None,
                   help="with int4: bf16 or int4 for prompt tokens (default: engine default)")


def _engine(model: Path, **kw):
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **kw))


def _prompts(tokenizer, items) -> tuple[list[str], list[list[int]]]:
    texts = [tokenizer.apply_chat_template(it.messages(), add_generation_prompt=True, tokenize=False)
             for it in items]
    return texts, [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run_stencil(engine, items, prompt_ids, concurrency: int, max_tokens: int) -> dict:
    from stencil.engine.request import SamplingParams
    from stencil.grammar.base import GrammarSpec

    grammars = [engine.grammar.compile(GrammarSpec.json_schema(it.schema)) for it in items]
    engine.kv.set_prefix_caching(engine.config.enable_prefix_caching)  # no hits from earlier runs
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    traces, wall = run_closed_loop(engine, prompt_ids, params, grammars, concurrency)
    validators = {}
    valid = [is_valid(t.text, validators.setdefault(id(it.schema), make_validator(it.schema)))
             for t, it in zip(traces, items)]
    return summarize(traces, wall, valid)


class OutlinesBaseline:
    """outlines 1.x over transformers, ``Generator.batch`` with greedy decoding."""

    def __init__(self, model_dir: Path):
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # outlines' compiled mask kernel: 8 s warm-up
        import outlines
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        # a GGUF file (the default model) is dequantized to fp32 on load, as transformers reads one
        where = dict(pretrained_model_name_or_path=str(model_dir.parent), gguf_file=model_dir.name) \
            if model_dir.is_file() else dict(pretrained_model_name_or_path=str(model_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(**where)
        self.hf = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
        self.model = outlines.from_transformers(self.hf, self.tokenizer)
        self.outlines = outlines
        self.generators: dict[str, object] = {}

    def generator(self, schema: dict):
        key = json.dumps(schema, sort_keys=True)
        if key not in self.generators:
            self.generators[key] = self.outlines.Generator(self.model, self.outlines.json_schema(schema))
        return self.generators[key]

    def run(self, items, texts: list[str], concurrency: int, max_tokens: int) -> dict:
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch
        eos = self.tokenizer.eos_token_id
        for it in items:
            self.generator(it.schema)  # compile outside the timed region, as for Stencil
        order = sorted(range(len(items)), key=lambda i: json.dumps(items[i].schema, sort_keys=True))
        batches: list[list[int]] = []
        for i in order:
            if batches and len(batches[-1]) < concurrency and items[batches[-1][0]].schema is items[i].schema:
                batches[-1].append(i)
            else:
                batches.append([i])

        class Recorder(StoppingCriteria):
            def __init__(self, traces: list[Trace]):
                self.traces = traces
                self.done = [False] * len(traces)

            def __call__(self, input_ids, scores, **kw):
                now = time.perf_counter()
                last = input_ids[:, -1].tolist()
                for r, tr in enumerate(self.traces):
                    if not self.done[r]:
                        tr.add(now, 1)
                        tr.token_ids.append(last[r])
                        self.done[r] = last[r] == eos
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        traces: list[Trace | None] = [None] * len(items)
        texts_out: list[str] = [""] * len(items)
        t0 = time.perf_counter()
        for batch in batches:
            start = time.perf_counter()
            bt = [Trace(submit=start) for _ in batch]
            rec = Recorder(bt)
            outs = self.generator(items[batch[0]].schema).batch(
                [texts[i] for i in batch], max_new_tokens=max_tokens, do_sample=False,
                stopping_criteria=StoppingCriteriaList([rec]))
            for k, i in enumerate(batch):
                traces[i] = bt[k]
                texts_out[i] = outs[k]
        wall = time.perf_counter() - t0
        validators = {}
        valid = [is_valid(texts_out[i], validators.setdefault(id(it.schema), make_validator(it.schema)))
                 for i, it in enumerate(items)]
        return summarize(traces, wall, valid)


def scenario_throughput(args, model: Path, engine, report: dict) -> None:
    from stencil.benchmarks.workload import extraction_items

    items = extraction_items(args.requests, seed=1)
    texts, ids = _prompts(engine.tokenizer, items)
    levels = [int(c) for c in args.concurrency.split(",")]
    baseline = None if args.no_baseline else OutlinesBaseline(model)
    rows = []
    for c in levels:
        s = run_stencil(engine, items, ids, c, args.max_tokens)
        row = {"concurrency": c, "stencil": s}
        print(f"[throughput] c={c} stencil {s['output_tokens_per_s']:.1f} tok/s valid {s['valid_fraction']:.2f}",
              flush=True)
        if baseline is not None:
            b = baseline.run(items, texts, c, args.max_tokens)
            row["baseline"] = b
            row["ratio_output_tokens_per_s"] = s["output_tokens_per_s"] / b["output_tokens_per_s"]
            print(f"[throughput] c={c} baseline {b['output_tokens_per_s']:.1f} tok/s valid "
                  f"{b['valid_fraction']:.2f} ratio {row['ratio_output_tokens_per_s']:.2f}", flush=True)
        rows.append(row)
    report["throughput"] = rows


def scenario_prefix_cache(args, engine, report: dict) -> None:
    from stencil.benchmarks.workload import shared_system_prompt
    from stencil.engine.request import SamplingParams

    system = shared_system_prompt(1000)
    questions = [f"Question {i}: which policy number mentions the {w}?" for i, w in
                 enumerate(["coffee", "budget", "tram", "audit", "archive", "drill", "badge", "kitchen"])]
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for q in questions]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {"shared_prefix_tokens": len(tok.encode(system))}
    for on in (True, False):
        engine.kv.set_prefix_caching(on)
        run_closed_loop(engine, prompts[:1], params, None, 1)  # warm: the first request fills the cache
        traces, _ = run_closed_loop(engine, prompts[1:], params, None, 1)
        out["ttft_ms_p50_on" if on else "ttft_ms_p50_off"] = pct([(t.first - t.submit) * 1e3 for t in traces], 50)
    engine.kv.set_prefix_caching(engine.config.enable_prefix_caching)
    out["ratio_on_off"] = out["ttft_ms_p50_on"] / out["ttft_ms_p50_off"]
    print(f"[prefix_cache] TTFT p50 on {out['ttft_ms_p50_on']:.1f} ms, off {out['ttft_ms_p50_off']:.1f} ms", flush=True)
    report["prefix_cache"] = out


def scenario_chunked_prefill(args, model: Path, report: dict, weights: dict) -> None:
    from stencil.benchmarks.workload import FILLER
    from stencil.engine.request import SamplingParams

    out: dict = {}
    for chunked in (True, False):
        chunk = args.chunk if chunked else 8192
        eng = _engine(model, max_prefill_chunk=chunk, max_num_batched_tokens=chunk + 64, max_num_seqs=32,
                      kv_cache_gib=1.0, **weights)
        tok = eng.tokenizer
        long_text = " ".join(FILLER[i % len(FILLER)] for i in range(400))
        long_ids = tok.encode(long_text, add_special_tokens=False)[:4000]
        decoders = [tok.encode(f"Count slowly from {i} to one thousand:", add_special_tokens=False) for i in range(16)]
        p_dec = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        traces = {f"d{i}": Trace(submit=time.perf_counter()) for i in range(16)}
        for i, ids in enumerate(decoders):
            eng.add_request(f"d{i}", ids, p_dec)
        window = [None, None]
        step = 0
        while eng.has_unfinished():
            if step == 20:
                eng.add_request("long", long_ids, SamplingParams(max_tokens=1, temperature=0))
                window[0] = time.perf_counter()
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == "long":
                    if o.finished:
                        window[1] = now
                    continue
                traces[o.request_id].add(now, len(o.new_token_ids))
            step += 1
        in_win, all_itl = [], []
        for tr in traces.values():
            times = tr.token_times
            for k in range(1, len(times)):
                gap = (times[k] - times[k - 1]) * 1e3
                all_itl.append(gap)
                if window[0] <= times[k] <= window[1] + 1e-9:
                    in_win.append(gap)
        if chunked:
            out["itl_ms_p50"] = pct(all_itl, 50)
            out["itl_ms_p99_chunked"] = pct(in_win, 99)
            out["long_prompt_prefill_ms_chunked"] = (window[1] - window[0]) * 1e3
        else:
            out["itl_ms_p50_unchunked_run"] = pct(all_itl, 50)
            out["itl_ms_p99_unchunked"] = pct(in_win, 99)
            out["long_prompt_prefill_ms_unchunked"] = (window[1] - window[0]) * 1e3
        out["long_prompt_tokens"] = len(long_ids)
        out["chunk_tokens"] = args.chunk
        del eng
    out["ratio_p99_chunked_to_p50"] = out["itl_ms_p99_chunked"] / out["itl_ms_p50"]
    print(f"[chunked_prefill] ITL p50 {out['itl_ms_p50']:.1f} ms; p99 while reading the long prompt: chunked "
          f"{out['itl_ms_p99_chunked']:.1f} ms, unchunked {out['itl_ms_p99_unchunked']:.1f} ms", flush=True)
    report["chunked_prefill"] = out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.get("throughput", [])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    if rows:
        cs = [str(r["concurrency"]) for r in rows]
        x = range(len(cs))
        axes[0].bar([i - 0.2 for i in x], [r["stencil"]["output_tokens_per_s"] for r in rows], 0.4, label="Stencil")
        if "baseline" in rows[0]:
            axes[0].bar([i + 0.2 for i in x], [r["baseline"]["output_tokens_per_s"] for r in rows], 0.4,
                        label="outlines + transformers")
        axes[0].set_xticks(list(x), cs)
        axes[0].set_xlabel("concurrency")
        axes[0].set_ylabel("output tokens/s")
        axes[0].legend()
        axes[0].set_title("Structured extraction throughput")
    pc = report.get("prefix_cache")
    if pc:
        axes[1].bar(["cache on", "cache off"], [pc["ttft_ms_p50_on"], pc["ttft_ms_p50_off"]])
        axes[1].set_ylabel("TTFT p50 (ms)")
        axes[1].set_title(f"Shared {pc['shared_prefix_tokens']}-token prefix")
    cp = report.get("chunked_prefill")
    if cp:
        axes[2].bar(["ITL p50", "p99 chunked", "p99 unchunked"],
                    [cp["itl_ms_p50"], cp["itl_ms_p99_chunked"], cp["itl_ms_p99_unchunked"]])
        axes[2].set_ylabel("ms")
        axes[2].set_title("Decode ITL while a 4k prompt is read")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from stencil.engine.models.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    weights = {"weights": args.weights} if args.weights else {}
    if args.prompt_weights:
        weights["prompt_weights"] = args.prompt_weights
    scenarios = set(args.scenarios.split(","))
    report: dict = {"model": str(model), "max_tokens": args.max_tokens}
    engine = _engine(model, max_num_seqs=64, kv_cache_gib=2.0, **weights)
    report["kv_blocks"] = engine.kv.num_blocks
    if "throughput" in scenarios:
        scenario_throughput(args, model, engine, report)
    if "prefix_cache" in scenarios:
        scenario_prefix_cache(args, engine, report)
    del engine
    if "chunked_prefill" in scenarios:
        scenario_chunked_prefill(args, model, report, weights)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    plot(report, args.plot or args.json.with_suffix(".png"))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
