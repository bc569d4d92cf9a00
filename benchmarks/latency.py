"""``stencil bench latency``: where the time of one request goes, phase by phase, over HTTP.

``stencil bench latency [--requests 12] [--max-tokens 64] [--stream] [--serve-args "--speculative off"] --json PATH``

One ``stencil serve`` app runs in this process (uvicorn on a loopback port, the engine on its
thread, configured exactly as ``stencil serve`` with ``--serve-args``: its defaults unless
told otherwise); one client sends the person-extraction
chat requests of the peers comparison (``stencil.benchmarks.workload.person_items``: about 40 prompt
tokens, name/age/city) to ``POST /v1/chat/completions`` (a base model, whose tokenizer has no chat
template: their text prompts to ``POST /v1/completions``), one at a time, first with
``response_format: json_schema`` (strict), then without a response format. Each request's time,
from the client's send to its last byte, is cut into consecutive phases by probes that wrap the
service's and the engine's own functions (the app's code is unchanged; the probes cost about a
microsecond each):

``http_in`` client send → the ASGI app · ``validate`` body decoding, wire types, request checks
(→ the template) · ``template_tokenize`` chat template and tokenizer · ``params`` sampling
parameters, schema checks, grammar spec · ``admit`` the compile started (it runs on the
compiler's pool from here), engine checks, submission to the engine thread · ``queue`` → the
first engine step · ``prefill`` the steps up to the one that gave the first token (the prompt
read in chunks, all but its last token while the grammar compiles) · ``grammar`` the time
between those steps: what the compile added to TTFT beyond the prefill (about 0 when the
compile hides behind it) · ``decode`` every later step · ``loop`` the engine loop between
those steps (delivery of outputs, inbox, waits) · ``deliver`` last step → the service has the
whole answer · ``validate_output`` jsonschema on the answer · ``response`` → the client has the
last byte (encoding, HTTP). Besides the phases: ``ttft_ms`` (send → the engine's first token)
and ``compile_ms`` (the compile's own time, overlapping the phases).

Variants: ``json_schema`` (the same schema every time: the first request is cold, the rest hit
the compiler's cache), ``json_schema_cold`` (a schema never seen before on every request: one
more optional property with a fresh name), ``none`` (no response format). A warm-up request
(another schema) runs first, so ``cold`` means a cold grammar, not a cold model.
``--prompt-tokens N`` pads each prompt with filler sentences to about N tokens (each request starts
with its own tag, so none reads its prompt from another's cached blocks); ``--schema FILE``
asks for that schema instead of the person schema. The report's ``ttft_cold_over_warm`` is the
median TTFT of ``json_schema_cold`` over that of ``json_schema``'s warm requests.

Inside the steps, ``steps`` splits the step time into ``schedule``, ``grammar_mask``,
``forward`` (model, LM head, sampling), ``update`` (append, stop checks, matcher advance),
``detokenize`` and ``propose`` (drafts), summed over the request's steps, with the number of
steps and the median decode step. The first request of the run is reported apart as ``cold``
(first grammar compile, first forward); the rest give ``warm`` medians per phase. Timings are
wall-clock on a shared machine: compare phases within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shlex
import socket
import statistics
import threading
import time
from pathlib import Path

PHASES = ("http_in", "validate", "template_tokenize", "params", "admit", "queue", "prefill", "grammar",
          "decode", "loop", "deliver", "validate_output", "response")
STEP_PARTS = ("schedule", "grammar_mask", "forward", "update", "detokenize", "propose")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--requests", type=int, default=12, help="requests per variant (the first is cold)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="streamed requests (SSE) instead of whole answers")
    p.add_argument("--serve-args", default="", help="options of stencil serve for the app, in one string "
                   "(e.g. \"--speculative off --threads 1\"); host and port are the benchmark's")
    p.add_argument("--variants", default="json_schema,none",
                   help="comma-separated: json_schema, json_schema_cold, none")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="pad each prompt with filler sentences to about this many tokens (0: as it is)")
    p.add_argument("--schema", type=Path, default=None,
                   help="a JSON Schema file to ask for (default: the person schema of the items)")


# -- probes ----------------------------------------------------------------------------------------

class Probes:
    """Wraps named functions so that each call records ``(name, start, end)`` (perf_counter s).

    Calls may come from any thread (list appends are atomic under the GIL). ``restore()``
    puts every original back.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        events = self.events
        if asyncio.iscoroutinefunction(original):
            @functools.wraps(original)
            async def timed_async(*a, **k):
                t = time.perf_counter()
                try:
                    return await original(*a, **k)
                finally:
                    events.append((name, t, time.perf_counter()))
            wrapper = timed_async
        else:
            @functools.wraps(original)
            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    events.append((name, t, time.perf_counter()))
            wrapper = timed
        # Only instance or module attributes are set (and later removed or put back).
        self._undo.append((owner, attr, owner.__dict__.get(attr) if hasattr(owner, "__dict__") else original))
        setattr(owner, attr, wrapper)

    def mark(self, name: str) -> None:
        t = time.perf_counter()
        self.events.append((name, t, t))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()

    def take(self) -> list[tuple[str, float, float]]:
        out, self.events[:] = list(self.events), []
        return out


def install(probes: Probes, state) -> None:
    """Probe the service's request path and the engine's step (``state``: the app's ServiceState)."""
    from stencil.engine.detokenizer import IncrementalDetokenizer
    from stencil.service import inputs

    eng = state.engine.engine
    probes.wrap(inputs, "tokenize", "tokenize")
    probes.wrap(inputs, "sampling_params", "sampling_params")
    probes.wrap(inputs, "grammar_spec", "grammar_spec")
    probes.wrap(state.engine, "compile_grammar", "compile")
    start_compile = state.engine.grammar_future

    def grammar_future(*a, **k):  # the compile starts here and ends when its future does
        t = time.perf_counter()
        future = start_compile(*a, **k)
        future.add_done_callback(lambda _: probes.events.append(("compile", t, time.perf_counter())))
        return future

    probes._undo.append((state.engine, "grammar_future", None))
    state.engine.grammar_future = grammar_future
    output = eng._output

    def first_output(req, new):  # the engine's first token of a request
        if new and not req.output_token_ids[:-len(new)]:
            probes.mark("first_token")
        return output(req, new)

    probes._undo.append((eng, "_output", None))
    eng._output = first_output
    probes.wrap(eng, "add_request", "add_request")
    probes.wrap(eng, "step", "step")
    probes.wrap(eng.scheduler, "schedule", "schedule")
    probes.wrap(eng.structured, "grammar_bitmask", "grammar_mask")
    probes.wrap(eng.runner, "execute", "forward")
    probes.wrap(eng, "_update", "update")
    probes.wrap(eng, "_propose", "propose")
    probes.wrap(IncrementalDetokenizer, "push", "detokenize")
    probes.wrap(IncrementalDetokenizer, "finish", "detokenize")
    probes.wrap(state.checker, "check", "validate_output")


def asgi_probe(app, probes: Probes):
    """The ASGI ``app`` with a mark at each HTTP request's entry (``asgi_in``)."""
    async def probed(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1/chat", "/v1/completions", "/generate")):
            probes.mark("asgi_in")
        await app(scope, receive, send)
    return probed


# -- one request's timeline ------------------------------------------------------------------------

def phases(events: list[tuple[str, float, float]], sent: float, received: float) -> dict:
    """Cut ``[sent, received]`` into ``PHASES`` (ms) from one request's probe events; plus
    ``steps`` (ms per part, summed), ``num_steps`` and ``decode_step_ms_p50``."""
    first = {}
    for name, s, e in events:
        first.setdefault(name, (s, e))
    forwards = [s for n, s, e in events if n == "forward"]
    steps = sorted((s, e) for n, s, e in events if n == "step")
    # Steps of this request only (the engine may also step while nothing of ours runs: never at
    # c=1), and only those that ran the model (an idle step waits for a grammar).
    steps = [(s, e) for s, e in steps if s >= first["add_request"][1] and any(s <= f <= e for f in forwards)] \
        if "add_request" in first else []
    check = first.get("validate_output", (received, received))
    tok = first["tokenize"]
    add = first["add_request"]
    compile_ = first.get("compile")
    bounds = {"http_in": (sent, first["asgi_in"][0]), "validate": (first["asgi_in"][0], tok[0]),
              "template_tokenize": tok}
    params_end = min(compile_[0], add[0]) if compile_ else add[0]
    bounds["params"] = (tok[1], params_end)
    bounds["admit"] = (params_end, max(add[1], params_end))
    bounds["queue"] = (bounds["admit"][1], steps[0][0] if steps else bounds["admit"][1])
    out = {k: (e - s) * 1e3 for k, (s, e) in bounds.items()}
    token_at = first.get("first_token", (steps[0][1], steps[0][1]) if steps else (add[1], add[1]))[0]
    k = next((i for i, (s, e) in enumerate(steps) if s <= token_at <= e), 0) + 1 if steps else 0
    prefill, later = steps[:k], steps[k:]
    out["prefill"] = sum((e - s) * 1e3 for s, e in prefill)
    out["grammar"] = sum((b[0] - a[1]) * 1e3 for a, b in zip(prefill, prefill[1:]))
    decode = [(e - s) * 1e3 for s, e in later]
    out["decode"] = sum(decode)
    out["loop"] = sum((b[0] - a[1]) * 1e3 for a, b in zip(steps[k - 1:k] + later, later)) if later else 0.0
    last = steps[-1][1] if steps else add[1]
    out["deliver"] = (check[0] - last) * 1e3
    out["validate_output"] = (check[1] - check[0]) * 1e3
    out["response"] = (received - check[1]) * 1e3
    parts = {p: 0.0 for p in STEP_PARTS}
    if steps:
        lo, hi = steps[0][0], steps[-1][1]
        for name, s, e in events:
            if name in parts and lo <= s and e <= hi:
                parts[name] += (e - s) * 1e3
        parts["update"] -= parts["detokenize"]  # detokenizing runs inside the update
    return {"phases": out, "total_ms": (received - sent) * 1e3, "steps": parts, "num_steps": len(steps),
            "decode_step_ms_p50": statistics.median(decode) if decode else None,
            "ttft_ms": (token_at - sent) * 1e3, "compile_ms": (compile_[1] - compile_[0]) * 1e3 if compile_ else 0.0}


def _medians(rows: list[dict]) -> dict:
    keys = rows[0]["phases"].keys()
    return {"phases": {k: statistics.median(r["phases"][k] for r in rows) for k in keys},
            "steps": {k: statistics.median(r["steps"][k] for r in rows) for k in STEP_PARTS},
            "total_ms": statistics.median(r["total_ms"] for r in rows),
            "num_steps": statistics.median(r["num_steps"] for r in rows),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
            "compile_ms": statistics.median(r["compile_ms"] for r in rows),
            "decode_step_ms_p50": statistics.median(r["decode_step_ms_p50"] or 0.0 for r in rows)}


# -- running ---------------------------------------------------------------------------------------

def _serve(app, sock: socket.socket) -> tuple[threading.Thread, object]:
    import uvicorn

    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True)
    thread.start()
    return thread, server


def _send(http, url: str, body: dict, stream: bool) -> tuple[float, float, str]:
    """Send one request; (sent, received last byte, answer text)."""
    sent = time.perf_counter()
    if not stream:
        r = http.post(url, json=body)
        received = time.perf_counter()
        if r.status_code >= 400:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
        choice = r.json()["choices"][0]  # a chat's message, or a completion's text
        return sent, received, (choice["message"]["content"] if "message" in choice else choice.get("text")) or ""
    text = ""
    with http.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                for c in json.loads(line[5:]).get("choices") or []:
                    text += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return sent, time.perf_counter(), text


_FILLER = ("The archive keeps letters, ledgers and notes from many years, sorted by the clerks who wrote "
           "them, and nothing in this paragraph names the person asked about. ")


def padded(messages: list[dict], tokenizer, tokens: int) -> list[dict]:
    """``messages`` with filler sentences before the last one's text, to about ``tokens`` prompt
    tokens (the chat template's own tokens counted; never fewer than the messages had)."""
    out = [dict(m) for m in messages]
    if tokens <= 0:
        return out
    have = len(tokenizer.encode(tokenizer.apply_chat_template(out, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False))
    per = max(1, len(tokenizer.encode(_FILLER, add_special_tokens=False)))
    out[-1]["content"] = _FILLER * max(0, (tokens - have) // per) + out[-1]["content"]
    return out


def padded_prompt(it, tokenizer, tokens: int) -> str:
    """The text prompt of item ``it`` for a base model (``stencil.benchmarks.serve.completion_prompt``),
    filler sentences before its document to about ``tokens`` prompt tokens."""
    from stencil.benchmarks.serve import completion_prompt

    fields = list(it.schema["properties"])
    prompt = completion_prompt(it.instruction, it.document, fields)
    if tokens <= 0 or tokenizer is None:
        return prompt
    have = len(tokenizer.encode(prompt, add_special_tokens=False))
    per = max(1, len(tokenizer.encode(_FILLER, add_special_tokens=False)))
    return completion_prompt(it.instruction, _FILLER * max(0, (tokens - have) // per) + it.document, fields)


def fresh_schema(schema: dict, k: int) -> dict:
    """``schema`` with one more optional property, ``note_<k>``: a schema never compiled before."""
    s = json.loads(json.dumps(schema))
    if isinstance(s.get("properties"), dict):
        s["properties"][f"note_{k}"] = {"type": "string", "maxLength": 8}
    else:
        s = {"allOf": [s], "$comment": f"fresh {k}"}
    return s


def run_variant(http, url: str, model: str, probes: Probes, items, variant: str, max_tokens: int,
                stream: bool, tokenizer=None, prompt_tokens: int = 0, schema: dict | None = None,
                fresh_from: int = 0, api: str = "chat") -> dict:
    """``len(items)`` requests one after the other; the first is the cold one. ``api``: ``chat``
    (``url`` is ``/v1/chat/completions``) or ``completions`` (a base model: ``/v1/completions``
    with the items' text prompts)."""
    from stencil.benchmarks.serve import Dialect, Job, request_body, tagged

    rows, texts = [], []
    for k, it in enumerate(items):
        ask = schema if schema is not None else it.schema
        if variant == "json_schema_cold":
            ask = fresh_schema(ask, fresh_from + k)
        if api == "completions":
            job = Job(it.messages(), ask, prompt=padded_prompt(it, tokenizer, prompt_tokens))
        else:
            job = Job(padded(it.messages(), tokenizer, prompt_tokens) if tokenizer is not None else it.messages(), ask)
        # Its own first words: no request reads its prompt from another's cached blocks (the
        # filler and the instructions are shared), so each TTFT is of a prompt actually read.
        job = tagged(job, f"[{variant} {fresh_from + k}]")
        body = request_body(job, model, max_tokens, stream=False, dialect=Dialect(api))
        if variant == "none":
            del body["response_format"]
        probes.take()
        sent, received, text = _send(http, url, body, stream)
        time.sleep(0.05)  # let the engine thread finish its bookkeeping before reading events
        rows.append(phases(probes.take(), sent, received))
        texts.append(text)
    warm = rows[1:] or rows
    return {"cold": rows[0], "warm": _medians(warm), "requests": rows, "texts": texts}


def main(args: argparse.Namespace) -> int:
    import httpx

    from stencil.benchmarks.workload import person_items
    from stencil.service.app import create_app
    from stencil.service.cli import build_parser, engine_config_from_args, service_config_from_args
    from stencil.service.state import service_state

    serve = build_parser().parse_args(["serve", *shlex.split(args.serve_args)])
    if args.model is not None:
        serve.model = args.model
    serve.api_key = ""
    cfg = engine_config_from_args(serve)
    model = cfg.model
    app = create_app(cfg, service_config_from_args(serve))
    probes = Probes()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread, server = _serve(asgi_probe(app, probes), sock)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"  # or /v1/completions: a base model, below
    report: dict = {"model": str(model), "max_tokens": args.max_tokens, "stream": args.stream,
                    "serve_args": args.serve_args, "speculative": cfg.speculative, "threads": cfg.num_threads,
                    "variants": {}}
    try:
        deadline = time.monotonic() + 600
        while service_state(app) is None or not getattr(server, "started", False):
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the app did not start")
            time.sleep(0.1)
        state = service_state(app)
        install(probes, state)
        items = person_items(args.requests, seed=11)
        schema = json.loads(args.schema.read_text()) if args.schema is not None else None
        tok = state.engine.tokenizer
        api = "chat" if getattr(tok, "chat_template", None) else "completions"  # a base model: text prompts
        if api == "completions":
            url = url.replace("/chat/completions", "/completions")
        report["prompt_tokens"] = args.prompt_tokens
        report["api"] = api
        with httpx.Client(timeout=600) as http:
            # Warm-up: the first forward and the first compile of the run are not the cold grammar's.
            run_variant(http, url, state.model_name, probes, items[:1], "json_schema_cold", args.max_tokens,
                        args.stream, tok, args.prompt_tokens, schema, fresh_from=10**6, api=api)
            for variant in [v for v in args.variants.split(",") if v]:
                r = run_variant(http, url, state.model_name, probes, items, variant, args.max_tokens,
                                args.stream, tok, args.prompt_tokens, schema, api=api)
                report["variants"][variant] = r
                _print(variant, r)
        v = report["variants"]
        if "json_schema_cold" in v and "json_schema" in v:
            cold = statistics.median(r["ttft_ms"] for r in v["json_schema_cold"]["requests"])
            report["ttft_cold_over_warm"] = round(cold / v["json_schema"]["warm"]["ttft_ms"], 4)
            print(f"[latency] TTFT of a never-seen schema over a warm one: {report['ttft_cold_over_warm']:.3f}")
    finally:
        probes.restore()
        server.should_exit = True
        thread.join(60)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print(f"wrote {args.json}")
    return 0


def _print(variant: str, r: dict) -> None:
    for label in ("cold", "warm"):
        x = r[label]
        ph = ", ".join(f"{k} {v:.1f}" for k, v in x["phases"].items())
        st = ", ".join(f"{k} {v:.1f}" for k, v in x["steps"].items())
        print(f"[latency] {variant} {label}: total {x['total_ms']:.1f} ms, ttft {x['ttft_ms']:.1f} ms, "
              f"compile {x['compile_ms']:.1f} ms, {x['num_steps']:.0f} steps "
              f"(decode p50 {x['decode_step_ms_p50'] or 0:.1f} ms)\n    phases: {ph}\n    steps: {st}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
