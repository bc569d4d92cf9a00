"""``stencil bench tools``: tool-call grammars at agent scale (10-500 functions).

``stencil bench tools [--tools 10,50,100,300] [--corpus ../shared/corpora/bfcl] [--model PATH]
[--no-serve] [--json PATH]``

The functions: BFCL's (``question/*.json``, deduplicated by name, their types written as JSON
Schema's: ``dict`` → ``object``, ``float`` → ``number``, ...; names with ``.`` written with ``_``;
a function whose parameters admit no value, e.g. a ``required`` name it does not declare, is left
out and counted) interleaved with generated ones (one in four, or all without the corpus) whose
parameters nest ``$defs`` three deep (an order of line items with an address), from a seeded
generator. Every size takes the first N of that one list, so each size extends the one before.

Per size, on one ``GrammarCompiler`` over the model's tokenizer (policy ``lazy``: the ``auto``
policy would start an eager index build in a child process at a grammar's second sighting,
which would share the CPUs with the next measurement), ms:

* ``cold``: the answer's grammar (``tool_choice: auto``, parallel calls) of a list none of whose
  functions was seen before: ``tool_call_spec`` with an empty ``CallParts`` + the compile.
* ``first_mask``: then a matcher and its first bitmask.
* ``warm``: the same list again (the parts and the compiler's cache hit).
* ``extended``: the list with one more function (only that one is translated; the backend
  builds the new answer's grammar).
* ``regex_cold``: the whole answer as one regex (the only form before the Lark form), cold.
* ``cold_over_single``: ``cold`` over the median cold compile of one function alone.

Then the engine (``LLMEngine``, the default model unless ``--model``): per size that fits, the
prompt the service writes (the chat template's messages with the tools, through
``stencil.service.tools.template_messages``) is run three times with ``max_tokens`` 1, prefix
caching off: without a grammar, with the tools' grammar (``tool_call_spec`` on a cold
``CallParts`` and a compiler that has not seen the list, submitted as the service does, so the
compile runs while the prompt is read), and without again. ``ttft_ratio`` = with / the mean of
the two without. ``fits_up_to``: the largest number of the functions whose prompt fits
``max_model_len``; its TTFT is measured too (``ttft_at_fit``) when it is not one of the sizes.

Last (unless ``--no-serve``), the service: one chat request per size (and at ``fits_up_to`` and
one more) to the app in this process (Litestar's test client), ``tool_choice: auto``,
``max_tokens`` 4: a list that fits must be answered 200, one that does not a 400 (``names_context``:
whether its message names ``max_model_len``; the service's ``max_prompt_chars`` may refuse first,
counting the system message the tools are written into); any other status fails the benchmark
(exit 1).

Each compile measurement starts once the compiler's background thread has run what the last one
queued there (``GrammarCompiler.settle``: a Lark answer's shortest output, read for the budget's
admission check off the compile's path, ~25 ms at 100 functions). Every measurement runs with the
heap frozen (``gc.freeze``), as ``stencil serve``'s is once loaded.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULT_CORPUS = Path("../shared/corpora/bfcl")
_TYPES = {"dict": "object", "float": "number", "double": "number", "tuple": "array", "String": "string",
          "Array": "array", "ArrayList": "array", "HashMap": "object", "long": "integer", "Boolean": "boolean",
          "char": "string", "int": "integer", "bool": "boolean", "list": "array", "str": "string"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tools", default="10,50,100,300", help="comma-separated numbers of functions")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="BFCL's data folder (question/*.json); absent: generated functions only")
    parser.add_argument("--model", type=Path, default=None, help="model (default: SmolLM2-135M-Instruct's GGUF)")
    parser.add_argument("--seed", type=int, default=0, help="the generator's and the BFCL order's seed")
    parser.add_argument("--no-serve", action="store_true", help="skip the service's status check")
    parser.add_argument("--json", type=Path, default=None, help="where to write the report")


# -- the functions ----------------------------------------------------------------------------------

def bfcl_functions(corpus: Path) -> tuple[list[dict], int]:
    """BFCL's functions as OpenAI function definitions (``name``, ``description``,
    ``parameters``), first sighting of each name, in file order; and how many were left out
    because the grammar refuses their parameters (none admits a value)."""
    from stencil.grammar.base import GrammarError
    from stencil.grammar.json_schema.schema_compiler import schema_to_regex
    from stencil.grammar.tool_calls import arguments_schema

    out, seen, refused = [], set(), 0
    for path in sorted((corpus / "question").glob("*.json")):
        for line in path.read_text().splitlines():
            for fn in json.loads(line).get("function", []):
                name = "".join(c if c.isalnum() or c in "_-" else "_" for c in fn["name"])[:64]
                if name in seen:
                    continue
                seen.add(name)
                params = _json_schema(fn.get("parameters") or {})
                try:
                    schema_to_regex(arguments_schema(params), strict=False)
                except GrammarError:
                    refused += 1
                    continue
                out.append({"name": name, "description": fn.get("description", ""), "parameters": params})
    return out, refused


def _json_schema(node):
    """BFCL's parameter types written as JSON Schema's (``any``: no type)."""
    if isinstance(node, list):
        return [_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "type" and isinstance(v, str):
            if v != "any":
                out[k] = _TYPES.get(v, v)
        elif k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _json_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "anyOf", "oneOf", "allOf"):
            out[k] = _json_schema(v)
        else:
            out[k] = v
    return out


_VERBS = ("create", "update", "list", "cancel", "quote", "ship", "price", "audit")
_NOUNS = ("order", "invoice", "shipment", "basket", "refund", "booking", "ticket", "parcel")


def generated_function(i: int, rng: random.Random) -> dict:
    """One function whose parameters nest ``$defs`` (Order → Item, Address): property counts,
    enums and bounds drawn from ``rng``."""
    currencies = rng.sample(["EUR", "USD", "GBP", "JPY", "CHF", "SEK"], rng.randint(2, 4))
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": rng.choice([8, 12, 16])},
        "qty": {"type": "integer", "minimum": 1, "maximum": rng.choice([9, 99, 999])},
        "unit_price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": rng.randint(1, 3)}},
        "required": ["sku", "qty"]}
    address = {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 24},
        "country": {"enum": rng.sample(["FR", "DE", "IT", "ES", "US", "JP", "SE"], 3)},
        "zip": {"type": "string", "pattern": "^[0-9]{4,6}$"}}, "required": ["city", "country"]}
    order = {"type": "object", "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": rng.randint(2, 5)},
        "ship_to": {"$ref": "#/$defs/Address"}, "currency": {"enum": currencies}},
        "required": ["items"]}
    props = {"order": {"$ref": "#/$defs/Order"},
             "note": {"type": "string", "maxLength": rng.choice([32, 64, 128])},
             "urgent": {"type": "boolean"}}
    for k in range(rng.randint(0, 3)):
        props[f"option_{k}"] = rng.choice([{"type": "integer"}, {"type": "boolean"},
                                           {"enum": ["low", "mid", "high"]}, {"type": "string", "maxLength": 20}])
    name = f"{_VERBS[i % len(_VERBS)]}_{_NOUNS[(i // len(_VERBS)) % len(_NOUNS)]}_{i}"
    return {"name": name, "description": f"{name.replace('_', ' ')} for one customer order",
            "parameters": {"$defs": {"Item": item, "Address": address, "Order": order}, "type": "object",
                           "properties": props, "required": ["order"]}}


def tool_functions(n: int, corpus: Path | None, seed: int) -> tuple[list[dict], dict]:
    """``n`` functions: BFCL's (shuffled by ``seed``) with one generated in every four, or all
    generated without a corpus; and where they come from."""
    rng = random.Random(seed)
    bfcl, refused = bfcl_functions(corpus) if corpus is not None and (corpus / "question").is_dir() else ([], 0)
    rng.shuffle(bfcl)
    out, b, g = [], iter(bfcl), 0
    while len(out) < n:
        fn = next(b, None) if len(out) % 4 != 3 else None
        if fn is None:
            fn = generated_function(g, rng)
            g += 1
        out.append(fn)
    return out, {"bfcl": n - g, "generated": g, "bfcl_refused": refused}


# -- the grammar ------------------------------------------------------------------------------------

def _calls(functions: list[dict]):
    from stencil.grammar.tool_calls import ToolCalls, ToolFunction

    return ToolCalls(tuple(ToolFunction(f["name"], f["parameters"]) for f in functions), required=False,
                     parallel=True)


def compile_rows(functions: list[dict], sizes: list[int], tokenizer) -> tuple[list[dict], float]:
    """Per size, the grammar's figures (see the module docstring); and a single function's cold
    compile (ms, median of five)."""
    from stencil.grammar.bitmask import allocate_bitmask
    from stencil.grammar.compiler import GrammarCompiler
    from stencil.grammar.tool_calls import CallParts, tool_call_spec

    def timed(fns, parts, **kw):
        compiler.settle()  # (the last compile's follow-up work, off its path, done before this one)
        start = time.perf_counter()
        grammar = compiler.compile(tool_call_spec(_calls(fns), parts=parts, **kw)[0])
        return grammar, (time.perf_counter() - start) * 1e3

    bitmask = allocate_bitmask(1, len(tokenizer))
    with GrammarCompiler(tokenizer, len(tokenizer), backend="lazy", timeout_s=120) as compiler, _frozen_heap():
        compiler.warm_up()
        timed([generated_function(10**6, random.Random(1))], CallParts())  # first-use costs, not a size's
        singles = [timed([generated_function(10**6 + k, random.Random(k))], CallParts())[1] for k in range(5)]
        single = statistics.median(singles)
        rows = []
        for n in sizes:
            fns, parts = functions[:n], CallParts()
            grammar, cold = timed(fns, parts)
            start = time.perf_counter()
            grammar.matcher().fill_bitmask(bitmask, 0)
            first_mask = (time.perf_counter() - start) * 1e3
            _, warm = timed(fns, parts)
            _, extended = timed(functions[:n + 1], parts)
            regex_cold = cold  # (a small answer is a regex already: the same spec, a cache hit now)
            if grammar.program.kind != "regex":
                _, regex_cold = timed(fns, CallParts(), lark_from_chars=1 << 62)
            rows.append({"tools": n, "tools_kb": round(len(json.dumps(fns)) / 1024, 1), "form": grammar.program.kind,
                         "cold_ms": cold, "first_mask_ms": first_mask, "warm_ms": warm, "extended_ms": extended,
                         "regex_cold_ms": regex_cold, "cold_over_single": cold / single,
                         "part_compiles": parts.compiles})
            print(f"[tools] {n} tools: grammar {rows[-1]['form']}, cold {cold:.1f} ms, first mask {first_mask:.2f} ms, "
                  f"warm {warm:.2f} ms, extended {extended:.1f} ms, regex cold {regex_cold:.1f} ms", flush=True)
    return rows, single


@contextmanager
def _frozen_heap():
    """What ``stencil serve`` does once loaded (``create_app(freeze_heap=True)``): every object
    alive moves to the collector's permanent generation, so a full collection during a
    measurement scans only what came after (here ~170 ms each otherwise, at random points)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# -- the engine -------------------------------------------------------------------------------------

_QUESTION = "Which function fits best for reordering two boxes of A4 paper to Paris? Call it."


def _prompt(tokenizer, functions: list[dict]) -> list[int]:
    """The prompt ids the service writes for one user question and these tools (auto, parallel)."""
    from stencil.schemas.openai import ChatMessage, FunctionDefinition
    from stencil.service.tool_formats import HERMES_FORMAT
    from stencil.service.tools import (plan_tools, template_messages, template_renders_calls,
                                       template_supports_tools)

    defs = [FunctionDefinition(f["name"], f.get("description"), f["parameters"]) for f in functions]
    plan = plan_tools(defs, "auto", syntax=HERMES_FORMAT.syntax)
    template = getattr(tokenizer, "chat_template", None)
    native = template_supports_tools(template)
    messages, tools = template_messages([ChatMessage(role="user", content=_QUESTION)], plan, native, HERMES_FORMAT,
                                        native_calls=native or template_renders_calls(template))
    kw = {"tools": tools} if tools is not None else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return tokenizer.encode(text, add_special_tokens=False)


def fits_up_to(tokenizer, functions: list[dict], max_model_len: int) -> int:
    """The largest ``n`` whose prompt with ``functions[:n]`` leaves an output token (bisection:
    the prompt grows with ``n``)."""
    lo, hi = 0, len(functions)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(_prompt(tokenizer, functions[:mid])) < max_model_len:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ttft_rows(engine, functions: list[dict], sizes: list[int]) -> list[dict]:
    """Per size that fits: TTFT without the grammar, with it (cold), without again (ms)."""
    from stencil.engine.request import SamplingParams
    from stencil.grammar.tool_calls import CallParts, tool_call_spec

    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []

    def first_token(prompt, grammar_of=None) -> float:
        start = time.perf_counter()
        grammar = None
        if grammar_of is not None:  # as the service: the spec, then the compile runs beside the prompt
            grammar = engine.grammar.submit(tool_call_spec(_calls(grammar_of), parts=CallParts())[0])
        rid = engine.add_request(None, prompt, params, grammar)
        while True:
            for out in engine.step():
                if out.request_id == rid and (out.new_token_ids or out.finished):
                    while engine.has_unfinished():
                        engine.step()
                    return (time.perf_counter() - start) * 1e3

    with _frozen_heap():
        for n in sizes:
            rows.append(_ttft_row(engine, functions[:n], first_token))
    return rows


def _ttft_row(engine, functions: list[dict], first_token) -> dict:
    """One size's TTFT row (``first_token(prompt, functions or None)``: ms)."""
    n, prompt = len(functions), _prompt(engine.tokenizer, functions)
    if len(prompt) >= engine.max_model_len:
        return {"tools": n, "prompt_tokens": len(prompt), "fits": False}
    without = first_token(prompt)
    with_tools = first_token(prompt, functions)
    again = first_token(prompt)
    print(f"[tools] {n} tools: {len(prompt)} prompt tokens, TTFT {with_tools:.0f} ms with the grammar, "
          f"{without:.0f} / {again:.0f} ms without", flush=True)
    return {"tools": n, "prompt_tokens": len(prompt), "fits": True, "ttft_without_ms": (without + again) / 2,
            "ttft_with_ms": with_tools, "ttft_ratio": with_tools / ((without + again) / 2)}


# -- the service ------------------------------------------------------------------------------------

def service_rows(model: Path, functions: list[dict], sizes: list[int], max_model_len: int,
                 fits: int) -> list[dict]:
    """Per size, the status of one chat request with the tools to the app in this process;
    ``ok``: 200 for a list that fits (at most ``fits`` functions), a 400 for one that does not
    (``names_context``: its message names ``max_model_len``; another limit may come first)."""
    from litestar.testing import TestClient

    from stencil.engine.config import EngineConfig
    from stencil.service.app import create_app
    from stencil.service.state import ServiceConfig

    app = create_app(EngineConfig(model=model, enable_prefix_caching=False), ServiceConfig(api_key=""))
    rows = []
    with TestClient(app, timeout=600) as client:
        for n in sizes:
            body = {"messages": [{"role": "user", "content": _QUESTION}], "max_tokens": 4,
                    "tools": [{"type": "function", "function": f} for f in functions[:n]], "tool_choice": "auto"}
            r = client.post("/v1/chat/completions", json=body)
            text = r.text
            prompt = r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None
            names_context = r.status_code == 400 and f"max_model_len {max_model_len}" in text
            ok = r.status_code == 200 if n <= fits else r.status_code == 400
            rows.append({"tools": n, "status": r.status_code, "prompt_tokens": prompt, "ok": ok,
                         "names_context": names_context, "error": None if r.status_code == 200 else text[:300]})
            print(f"[tools] {n} tools: HTTP {r.status_code}" + ("" if r.status_code == 200 else f": {text[:160]}")
                  + ("" if ok else " (NOT OK)"), flush=True)
    return rows


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.maskbench_harness import cpu_model
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine
    from stencil.engine.models.default_model import ensure_default_model

    sizes = sorted({int(x) for x in args.tools.split(",") if x.strip()})
    model = args.model or ensure_default_model()
    functions, origin = tool_functions(max(sizes) + 1, args.corpus, args.seed)
    report: dict = {"cpu": cpu_model(), "model": str(model), "sizes": sizes, "functions": origin}
    print(f"[tools] functions: {origin}", flush=True)
    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False))
    rows, single = compile_rows(functions, sizes, engine.tokenizer)
    report["single_cold_ms"] = single
    report["max_model_len"] = engine.max_model_len
    report["fits_up_to"] = fits_up_to(engine.tokenizer, tool_functions(max(500, max(sizes)), args.corpus,
                                                                       args.seed)[0], engine.max_model_len)
    fit = report["fits_up_to"]
    ttft = {r["tools"]: r for r in ttft_rows(engine, functions if fit < len(functions) else
                                             tool_functions(fit + 1, args.corpus, args.seed)[0],
                                             sorted(set(sizes) | {fit}))}
    del engine  # (its memory, before the service loads the model again)
    for r in rows:
        r.update(ttft.pop(r["tools"]))
    report["rows"] = rows
    report["ttft_at_fit"] = ttft.get(fit)  # (the largest list that fits, when it is not one of the sizes)
    status = 0
    if not args.no_serve:
        probe = sorted(set(sizes) | {report["fits_up_to"], report["fits_up_to"] + 1})
        report["service"] = service_rows(model, functions if max(probe) < len(functions) else
                                         tool_functions(max(probe) + 1, args.corpus, args.seed)[0],
                                         probe, report["max_model_len"], report["fits_up_to"])
        status = 0 if all(r["ok"] for r in report["service"]) else 1
    _print(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return status


def _print(report: dict) -> None:
    print(f"CPU: {report['cpu']}; a single function cold: {report['single_cold_ms']:.1f} ms; "
          f"max_model_len {report['max_model_len']}: up to {report['fits_up_to']} of these functions fit")
    cols = ("tools", "tools_kb", "form", "cold_ms", "warm_ms", "extended_ms", "first_mask_ms", "regex_cold_ms",
            "cold_over_single", "prompt_tokens", "ttft_without_ms", "ttft_with_ms", "ttft_ratio")
    print(" ".join(f"{c:>16s}" for c in cols))
    for r in report["rows"]:
        print(" ".join(f"{_cell(r.get(c)):>16s}" for c in cols))
    t = report.get("ttft_at_fit")
    if t is not None:
        print(f"TTFT at {t['tools']} tools ({t['prompt_tokens']} prompt tokens, the most that fit): "
              f"{t['ttft_with_ms']:.0f} ms with the grammar, {t['ttft_without_ms']:.0f} ms without "
              f"(ratio {t['ttft_ratio']:.3f})")
    for r in report.get("service", []):
        why = "" if r["status"] == 200 else " naming the context" if r["names_context"] else " naming another limit"
        print(f"service: {r['tools']} tools → HTTP {r['status']}{why}" + ("" if r["ok"] else " (NOT OK)"))


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)
