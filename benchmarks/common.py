"""Shared pieces of the benchmarks: percentiles, closed-loop driving of the engine, validation."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np


def pct(values: list[float], q: float) -> float | None:
    """``q``-th percentile (0-100) or None for no values."""
    return float(np.percentile(values, q)) if values else None


@dataclass(slots=True)
class Trace:
    """Timing of one request (``time.perf_counter`` seconds)."""

    submit: float
    first: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each output token
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    forced_tokens: int = 0
    done: float | None = None  # when the whole answer had arrived

    def add(self, now: float, n_tokens: int) -> None:
        if n_tokens and self.first is None:
            self.first = now
        self.token_times.extend([now] * n_tokens)

    def itls(self) -> list[float]:
        """Inter-token latencies (s): the gap between successive outputs, split evenly over the
        tokens that arrived together (a verified draft run or forced tokens)."""
        out: list[float] = []
        times = self.token_times
        i = 1
        while i < len(times):
            j = i
            while j < len(times) and times[j] == times[i]:
                j += 1
            gap = times[i] - times[i - 1]
            out.extend([gap / (j - i)] * (j - i))
            i = j
        return out


def summarize(traces: list[Trace], wall_s: float, valid: list[bool]) -> dict:
    """Throughput and latency figures of one run (times in ms)."""
    out_tokens = sum(len(t.token_ids) for t in traces)
    ttfts = [(t.first - t.submit) * 1e3 for t in traces if t.first is not None]
    itls = [x * 1e3 for t in traces for x in t.itls()]
    return {
        "requests": len(traces),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s else None,
        "requests_per_s": len(traces) / wall_s if wall_s else None,
        "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p99": pct(ttfts, 99),
        "itl_ms_p50": pct(itls, 50), "itl_ms_p99": pct(itls, 99),
        "valid_fraction": sum(valid) / len(valid) if valid else None,
    }


def run_closed_loop(engine, prompts: list[list[int]], params, grammars: list | None, concurrency: int,
                    on_step=None) -> tuple[list[Trace], float]:
    """Keep ``concurrency`` requests in flight on a sync ``LLMEngine`` until all are done.

    Returns (per-request traces in input order, wall time in s).
    """
    n = len(prompts)
    plist = params if isinstance(params, list) else [params] * n
    traces: list[Trace | None] = [None] * n
    rid_to_i: dict[str, int] = {}
    nxt = 0
    live = 0
    t0 = time.perf_counter()
    while nxt < n or live:
        while nxt < n and live < concurrency:
            rid = f"b{nxt}-{id(traces)}"
            traces[nxt] = Trace(submit=time.perf_counter())
            engine.add_request(rid, prompts[nxt], plist[nxt], grammars[nxt] if grammars else None)
            rid_to_i[rid] = nxt
            nxt += 1
            live += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            tr = traces[rid_to_i[o.request_id]]
            tr.add(now, len(o.new_token_ids))
            tr.token_ids.extend(o.new_token_ids)
            tr.text += o.new_text
            if o.finished:
                tr.finish_reason = o.finish_reason
                tr.steps = o.num_steps
                tr.draft_tokens, tr.accepted_tokens = o.num_draft_tokens, o.num_accepted_tokens
                tr.forced_tokens = o.num_forced_tokens
                tr.verify_steps = o.num_verify_steps
                live -= 1
        if on_step is not None:
            on_step(now)
    return traces, time.perf_counter() - t0


def make_validator(schema: dict):
    """A reusable jsonschema validator (draft 2020-12, format checker on)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def is_valid(text: str, validator) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return validator.is_valid(doc)
