"""The ``stencil`` command: ``serve``, ``generate`` (one-shot, in process) and ``bench``.

``stencil bench NAME ...`` dispatches to the module of that name in ``benchmarks/`` (``stencil bench spec`` runs
``stencil.benchmarks.spec``), which exposes
``add_arguments(parser)`` and ``main(args) -> int | None``; modules are imported only when
used, so a missing one fails only its own command.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from pathlib import Path

from stencil.engine.models import registry
from stencil.grammar.backends import backend_registry

BENCHMARKS = {
    "conformance": "JSON Schema conformance of constrained outputs over a corpus",
    "maskbench": "MaskBench's own harness (jsonschemabench) on Stencil's grammar API",
    "first_mask": "a fresh process's first compile and first mask, with and without the compiler's warm-up",
    "throughput": "decode tokens/s and latency at several concurrencies",
    "spec": "speculative decoding on a copy-heavy extraction workload",
    "cpu_kernels": "native CPU GEMMs (int4, GGUF blocks) and paged attention against torch's, same run",
    "weights": "fp32 vs int4 weights: speed and quality",
    "soak": "long mixed load against a server; checks nothing leaks",
    "slowclients": "others' inter-token latency while a client reads a byte a second and 200 dribble headers",
    "fuzz": "schemathesis fuzzing of the API at any size (random, seeded; stateful; under a soak load)",
    "budget": "structured answers at 25-150% of their natural length: closed in time, valid",
    "cluster": "replicas on Ray Serve: prefix-affinity vs round-robin routing, and a replica kill",
    "serve": "the throughput workload over HTTP against one or two OpenAI-compatible servers (loopback)",
    "batch": "stencil batch --url against bench serve's client on the same requests and server; kill and resume",
    "overhead": "CPU time around the model per decode step, by phase, at several numbers of running requests",
    "latency": "one request end to end over HTTP, phase by phase, with and without a grammar",
    "accuracy": "field-level accuracy of extractions: compact vs flexible JSON vs unconstrained, and servers",
    "agreement": "next-token top-1 agreement with llama.cpp (and transformers) on one GGUF, teacher-forced",
    "rows": "one row through one quantized matrix per GGUF type: Stencil's block kernel against llama.cpp's "
            "(test-backend-ops), GB/s, same run",
    "peers": "llama-server against stencil serve on the same GGUF: requests/s, validity, field accuracy, "
             "decode at one request, resident memory",
    "tools": "tool-call grammars at 10-500 functions: compile cold/warm/extended, first mask, TTFT with/without, "
             "what fits the context, no 5xx",
}


# -- arguments -------------------------------------------------------------------------------------

def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory holding one, or an HF-format model directory (config.json + "
                        f"safetensors); architectures {registry.describe()} "
                        "(default: SmolLM2-135M-Instruct, fetched once into the cache: a small demo model "
                        "that shows the API; for real answers serve a stronger one, --model path/to/file.gguf)")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:0)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--weights", default="auto", choices=["auto", "fp32", "int4"],
                   help="weight format: dense fp32, int4 (GGUF 4-bit blocks, CPU) or auto")
    g.add_argument("--prompt-weights", default="auto", choices=["auto", "bf16", "int4"],
                   help="with int4: read prompt tokens through a dense bf16 copy (bf16: its low bits "
                        "may depend on prefill chunking), through int4, or auto (int4)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton", "flash"],
                   help="attention kernels (auto: cpu on CPU when it builds, flash or triton on CUDA)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="K/V cache dtype (auto: float16 for a GGUF model on CPU, as llama.cpp; else --dtype); "
                        "float16 or bfloat16 halve the cache and its memory traffic")
    g.add_argument("--no-hybrid-kv-cache", action="store_true",
                   help="keep every position of a sliding-window layer (Gemma 3's local layers) in the KV cache, "
                        "as the full-attention layers do, instead of only its window (docs/models.md, 'Gemma 3')")
    g.add_argument("--activation-precision", default="exact", choices=["exact", "int8"],
                   help="GGUF block kernels' activations: exact (two int8 terms a value, logits within fp32 "
                        "rounding of the dequantized model; default) or int8 (llama.cpp's one term: less integer "
                        "work, faster batches and prompts, lower agreement; docs/models.md, 'Activation precision')")
    g.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size in GiB (default: from free memory)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides --kv-cache-gib)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests in one engine step (default: %(default)s); also sizes a hybrid KV cache's "
                        "window pool (Gemma 3): set it to the concurrency served")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (tokens)")
    g.add_argument("--max-waiting", type=int, default=4096, help="waiting requests before new ones get 429")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--speculative", choices=["off", "ngram"], default="ngram",
                   help="server-default speculation (requests may override): n-gram drafts, switched "
                        "off by the engine wherever they do not raise measured goodput")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--grammar-timeout", type=float, default=10.0, help="longest grammar compile (s)")
    g.add_argument("--grammar-backend", choices=backend_registry.POLICIES, default="auto",
                   help="auto: a lazy llguidance matcher at once, an eager outlines-core index built "
                        "in the background for grammars used again; eager: wait for the index; "
                        "lazy: never build one")


def _reasoning_format_names() -> list[str]:
    from stencil.service.reasoning_formats import BY_NAME

    return list(BY_NAME)


def _tool_call_format_names() -> list[str]:
    from stencil.service.tool_formats import BY_NAME

    return list(BY_NAME)


def _add_service_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require this key (default: $STENCIL_API_KEY; empty = none)")
    g.add_argument("--model-name", default=None,
                   help="model id reported to clients (default: the GGUF file's stem or the directory name)")
    g.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (bytes)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="per-request deadline (s; default 300)")
    g.add_argument("--max-queue-wait", type=float, default=None,
                   help="longest wait for a running slot before a 429 (s; default: half the request timeout)")
    g.add_argument("--shutdown-grace", type=float, default=30.0, help="in-flight time allowed after SIGTERM (s)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file used instead of the model's own (vLLM's --chat-template): "
                        "for a model that carries none or a wrong one (default: the model's)")
    g.add_argument("--reasoning-format", default="auto", metavar="NAME",
                   help="how the model marks its reasoning: auto (default: detected from the chat template), "
                        "none (no reasoning split out), or one of: "
                        + ", ".join(_reasoning_format_names()))
    g.add_argument("--tool-call-format", default="auto", metavar="NAME",
                   help="the syntax the model writes tool calls in: auto (default: detected from the chat "
                        "template; hermes where it shows none), or one of: " + ", ".join(_tool_call_format_names()))
    g.add_argument("--reasoning-budget", type=int, default=None, metavar="TOKENS",
                   help="most reasoning tokens of any request (default: no cap but max_tokens; "
                        "reasoning_effort caps it further)")
    g.add_argument("--json-whitespace", default="flexible", choices=["flexible", "compact"],
                   help="layout of JSON Schema answers when a request does not choose (/generate's "
                        "whitespace; the OpenAI routes always): flexible lets the model pretty-print "
                        "(more fields right on small models, a few more tokens); compact has no free "
                        "whitespace")
    g.add_argument("--additional-properties", default="closed", choices=["closed", "schema"],
                   help="objects of a JSON Schema that declare properties and say nothing of "
                        "additionalProperties, when a request does not choose (/generate's "
                        "additional_properties; the OpenAI routes always): closed takes no other key "
                        "(OpenAI's strict outputs), schema takes any (JSON Schema's default)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-format", default="auto", choices=["auto", "text", "json"],
                   help="logs on stderr: text (one plain line each) or json (one object a line, request ids "
                        "as keys, for a log shipper); auto (default): text when stderr is a terminal, else json")


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    from stencil.service.http_limits import ConnectionLimits

    d = ConnectionLimits()
    g = p.add_argument_group("connections", "bounds on each HTTP connection, against slow or stalled clients "
                             "(docs/serving.md, 'Limits and failures'; not applied with --replicas, where Ray "
                             "Serve's proxy takes the connections)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds from a connection's open (or a request's first byte) to the end of the request "
                        "head; past it 408 and close (default: %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds from the end of the head to the end of the body; past it 408 and close (default: %(default)s)")
    g.add_argument("--send-timeout", type=float, default=d.send_timeout_s,
                   help="seconds a response may wait for a client that reads nothing; past it the connection "
                        "is dropped and its request aborted (default: %(default)s)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="seconds an idle kept-alive connection stays open (default: %(default)s)")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="largest request line plus headers (bytes); more is 431 (default: %(default)s)")
    g.add_argument("--write-buffer-bytes", type=int, default=d.write_buffer_bytes,
                   help="response bytes queued per connection before the handler waits for the client (default: %(default)s)")
    g.add_argument("--send-buffer-bytes", type=int, default=d.send_buffer_bytes,
                   help="kernel send buffer per connection (SO_SNDBUF; 0: the kernel's autotuning) (default: %(default)s)")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections plus running requests before new requests get uvicorn's 503 "
                        "(default: no limit; the waiting queue and its 429s bound the work)")


def connection_limits_from_args(args: argparse.Namespace):
    """``ConnectionLimits`` from parsed ``stencil serve`` arguments."""
    from stencil.service.http_limits import ConnectionLimits

    return ConnectionLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                            send_timeout_s=args.send_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                            max_header_bytes=args.max_header_bytes, write_buffer_bytes=args.write_buffer_bytes,
                            send_buffer_bytes=args.send_buffer_bytes or None,
                            limit_concurrency=args.limit_concurrency).validate()


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    from stencil.service.cluster import ROUTERS

    g = p.add_argument_group("cluster", "N engine replicas on Ray Serve behind this endpoint "
                             "(needs pip install 'stencil-serve[cluster]'; docs/serving.md, 'Replicas on Ray Serve')")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve (the minimum with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --replicas and this on queue length")
    g.add_argument("--router", default="affinity", choices=list(ROUTERS),
                   help="how requests pick a replica: affinity (longest cached prompt prefix, "
                        "default), round_robin, pow2 (Serve's default), ray_prefix (Ray's "
                        "PrefixCacheAffinityRouter)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica (1: one replica per GPU)")


class ModelArgError(Exception):
    """``--model`` names no model, or one Stencil cannot serve; the message is one line."""


def engine_config_from_args(args: argparse.Namespace, progress=None):
    """``EngineConfig`` from parsed engine arguments (the default model is fetched if needed,
    each step told to ``progress(line)`` when given).

    Raises:
        ModelArgError: ``--model`` names no model or an unsupported one (checked from its
            metadata before anything loads).
    """
    from stencil.engine.config import EngineConfig
    from stencil.engine.models.gguf_config import UnsupportedModelError
    from stencil.engine.models.loader import check_model
    from stencil.engine.models.source import ModelPathError

    model = args.model
    if model is None:
        from stencil.engine.models.default_model import ensure_default_model

        model = ensure_default_model(progress)
    try:
        check_model(model)
    except (ModelPathError, UnsupportedModelError) as e:
        raise ModelArgError(str(e)) from None
    return EngineConfig(
        model=Path(model), device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        activation_precision=args.activation_precision, hybrid_kv_cache=not args.no_hybrid_kv_cache,
        weights=args.weights,
        prompt_weights=args.prompt_weights, attention_backend=args.attention_backend, kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, max_waiting=args.max_waiting,
        num_threads=args.threads, grammar_timeout_s=args.grammar_timeout,
        grammar_backend=args.grammar_backend,
        speculative={"method": "ngram"} if args.speculative == "ngram" else None,
    ).validate()


def service_config_from_args(args: argparse.Namespace):
    """``ServiceConfig`` from parsed ``stencil serve`` arguments.

    Raises:
        ConfigError: a value out of range, or a ``--chat-template`` file that cannot be read or parsed.
    """
    from stencil.engine.config import ConfigError
    from stencil.service.state import ServiceConfig

    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template: cannot read {args.chat_template}: {e}") from None
    return ServiceConfig(api_key=args.api_key, model_name=args.model_name, max_tokens_cap=args.max_tokens_cap,
                         default_max_tokens=min(256, args.max_tokens_cap), max_body_bytes=args.max_body_bytes,
                         request_timeout_s=args.request_timeout, max_queue_wait_s=args.max_queue_wait,
                         shutdown_grace_s=args.shutdown_grace, json_whitespace=args.json_whitespace,
                         additional_properties=args.additional_properties,
                         chat_template=template, reasoning_format=args.reasoning_format,
                         tool_call_format=args.tool_call_format,
                         reasoning_budget=args.reasoning_budget).validate()


# -- commands --------------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    """``stencil serve``: its steps (fetching the default model, loading) and, once it answers, the
    ready lines go to stdout, for the person who started it; logs go to stderr."""
    from stencil.service.app import create_app
    from stencil.service.logs import configure_logging
    from stencil.service.server import ServerRunner
    from stencil.service.state import service_state

    configure_logging(args.log_level, args.log_format)
    if args.model is None and args.model_name is None:
        from stencil.engine.models.default_model import MODEL_NAME

        args.model_name = MODEL_NAME  # the default model's id, whatever file it is served from
    scfg = service_config_from_args(args)
    if args.replicas is not None:
        return _serve_cluster(args, scfg)
    limits = connection_limits_from_args(args)
    busy = port_in_use(args.host, args.port)
    if busy:  # said before the model loads, not after
        print(f"error: cannot listen on {args.host}:{args.port}: {busy}; pick another port with --port "
              f"(make serve PORT=8123)", file=sys.stderr)
        return 2
    runner = ServerRunner()
    config = engine_config_from_args(args, _say)
    if scfg.chat_template is not None:  # rendered with the model's tokenizer before the model loads
        from stencil.engine.models.tokenizer import load_tokenizer
        from stencil.service.prompts import check_template_renders

        tokenizer = load_tokenizer(config.model)
        tokenizer.chat_template = scfg.chat_template
        check_template_renders(tokenizer)
    _say(f"loading {model_id(config.model)} ({_size(config.model)}) on {config.device} ...")
    app = create_app(config, scfg, on_engine_dead=runner.engine_dead, freeze_heap=True)
    demo, keyed = args.model is None, bool(scfg.api_key)

    def ready(url: str) -> None:
        state = service_state(app)
        chat = state is None or bool(getattr(state.engine.tokenizer, "chat_template", None))
        _say(ready_text(url, demo=demo, api_key=keyed, chat=chat))

    return runner.run(app, args.host, args.port, grace_s=args.shutdown_grace, log_level=args.log_level,
                      limits=limits, on_ready=ready)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (e.g. ``[Errno 98] Address already in use``), else None;
    bound the way the server binds (``SO_REUSEADDR``), then released. Port 0 is never in use."""
    import socket

    if port == 0:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return str(e)
    return None


# The request the ready lines suggest (README's first): small, and answered right by the default model.
TRY_BODY = {"messages": [{"role": "user", "content": "John Smith is 42 years old and lives in Paris."}],
            "response_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                 "age": {"type": "integer"},
                                                                 "city": {"type": "string"}},
                                "required": ["name", "age", "city"]},
            "max_tokens": 64}
# The same for a base model, which has no chat template (so no ``messages``): a plain prompt.
TRY_BODY_PROMPT = {"prompt": "John Smith is 42 years old and lives in Paris. As JSON:",
                   **{k: v for k, v in TRY_BODY.items() if k != "messages"}}


def ready_text(url: str, *, demo: bool, api_key: bool = False, chat: bool = True) -> str:
    """What ``stencil serve`` prints once it answers: where, a curl to try (a ``/generate`` with a
    small schema), and, for the default model, that it is a demo and how to serve another.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        demo: the default model is served.
        api_key: the server wants a key (the curl then sends ``$STENCIL_API_KEY``, which it says).
        chat: the model has a chat template (else the curl sends a ``prompt``, not ``messages``).
    """
    auth = " -H \"Authorization: Bearer $STENCIL_API_KEY\"" if api_key else ""
    body = TRY_BODY if chat else TRY_BODY_PROMPT
    lines = [f"Stencil is ready on {url}",
             "Try" + (" (with the server's key in $STENCIL_API_KEY):" if api_key else ":"),
             f"  curl -s {url}/generate -H 'content-type: application/json'{auth} -d '{json.dumps(body)}'",
             f"API documentation: {url}/schema; OpenAI-compatible routes under {url}/v1"]
    if demo:
        lines.append("The default model (SmolLM2-135M-Instruct) is a small demo model; for real answers serve a "
                     "stronger one: stencil serve --model path/to/file.gguf")
    return "\n".join(lines)


def _say(line: str) -> None:
    print(line, flush=True)


def _size(path) -> str:
    """A model's size on disk, in MB (a directory: its files')."""
    path = Path(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return f"{sum(f.stat().st_size for f in files) / 1e6:.0f} MB"


def _serve_cluster(args: argparse.Namespace, scfg) -> int:
    """``stencil serve --replicas N``: the same API, served by N replicas on Ray Serve."""
    from stencil.engine.config import ConfigError
    from stencil.service.cluster.deploy import ClusterOptions, require_ray, serve_cluster

    try:
        require_ray()
    except RuntimeError as e:
        print(f"stencil serve: --replicas needs Ray Serve. {e}", file=sys.stderr)
        return 2
    try:
        opts = ClusterOptions(replicas=args.replicas, max_replicas=args.max_replicas, router=args.router,
                              replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                              graceful_shutdown_s=args.shutdown_grace).validate()
    except ConfigError as e:
        print(f"stencil serve: {e}", file=sys.stderr)
        return 2
    return serve_cluster(engine_config_from_args(args), scfg, opts, args.host, args.port)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _generate_once(args: argparse.Namespace) -> int:
    from stencil.engine.async_engine import AsyncEngine
    from stencil.service import generation, inputs
    from stencil.service.errors import to_problem
    from stencil.service.metrics import Metrics
    from stencil.service.state import ServiceConfig, ServiceState
    from stencil.service.validation import OutputChecker

    schema = None
    if args.schema is not None:
        try:
            schema = json.loads(Path(args.schema).read_text())
        except (OSError, ValueError) as e:
            _progress(f"error: cannot read schema {args.schema}: {e}")
            return 2
    config = engine_config_from_args(args)  # a model we cannot serve fails here, in one line
    t0 = time.perf_counter()
    _progress("loading model ...")
    aeng = await asyncio.to_thread(AsyncEngine, config)
    aeng.start()
    _progress(f"model ready in {time.perf_counter() - t0:.1f} s")
    cfg = ServiceConfig(max_tokens_cap=max(args.max_tokens, 1), default_max_tokens=max(args.max_tokens, 1))
    state = ServiceState(engine=aeng, config=cfg.validate(), metrics=Metrics(lambda: aeng),
                         checker=OutputChecker(), model_name=model_id(aeng.model_path))
    raw = args.raw or not getattr(aeng.tokenizer, "chat_template", None)
    if raw and not args.raw:  # a base model: PROMPT is the text to continue, as llama.cpp's CLI takes it
        _progress("this model has no chat template: PROMPT is sent as it is (as with --raw)")
    try:
        messages = None if raw else [{"role": "user", "content": args.prompt}]
        prompt_ids = await inputs.tokenize(state, prompt=args.prompt if raw else None, messages=messages,
                                               parse_special_tokens=raw and args.parse_special_tokens)
        params = inputs.sampling_params(cfg, max_tokens=args.max_tokens, temperature=args.temperature,
                                            seed=args.seed)
        spec = inputs.grammar_spec(cfg, response_schema=schema, regex=args.regex)
        if spec is not None:
            _progress("compiling grammar ...")
        gen = await generation.start(state, prompt_ids, params, spec, "cli-" + os.urandom(6).hex())
        _progress(f"generating (prompt {len(prompt_ids)} tokens) ...")
        result = None
        # In a terminal the answer is written to stdout as it comes, once; piped, stdout gets only
        # the final answer (pretty-printed JSON with --schema) and the stream goes to stderr.
        live = sys.stdout.isatty()
        stream = sys.stdout if live else sys.stderr
        async for item in gen:
            if isinstance(item, generation.GenerationDelta):
                stream.write(item.text)
                stream.flush()
            else:
                result = item
        if live:
            print(flush=True)
        _progress(f"\n{result.usage.completion_tokens} tokens in {result.timings.total_ms / 1e3:.2f} s, "
                  f"finish_reason={result.finish_reason}, valid={result.valid}")
        for w in result.warnings:
            _progress(f"warning: {w}")
        if not live:  # (in a terminal it was written above, as it came)
            print(json.dumps(result.output, ensure_ascii=False, indent=2)
                  if schema is not None and result.output is not None else result.text)
        return 0 if result.valid else 1
    except Exception as e:  # noqa: BLE001 - one-shot tool: report and exit non-zero
        problem, _ = to_problem(e)
        detail = problem.detail if problem.status < 500 else repr(e)
        _progress(f"error ({problem.status}): {detail}")
        return 2
    finally:
        from stencil.service.app import stop_engine

        await asyncio.to_thread(stop_engine, aeng)


def model_id(path) -> str:
    """The id clients see for a model path: a GGUF file's stem, else the directory's name (as
    ``stencil.service.app``)."""
    from stencil.engine.models.source import ModelPathError, resolve_model_path

    try:
        return resolve_model_path(path).name
    except ModelPathError:
        return Path(path).name


def cmd_generate(args: argparse.Namespace) -> int:
    from stencil.service.logs import configure_logging

    configure_logging("warning", "text")
    return asyncio.run(_generate_once(args))


def cmd_batch(args: argparse.Namespace, run=None) -> int:
    """``stencil batch``: INPUT's lines through the app ``stencil serve`` builds, in process (or ``--url``'s)."""
    from stencil.service import batch
    from stencil.service.logs import configure_logging

    configure_logging("warning", "text")

    def app_factory():
        from stencil.service.app import create_app

        if args.model is None and args.model_name is None:
            from stencil.engine.models.default_model import MODEL_NAME

            args.model_name = MODEL_NAME  # as stencil serve: the default model's id
        scfg = service_config_from_args(args)
        return create_app(engine_config_from_args(args, _progress), scfg), scfg.api_key

    return (run or batch.main)(args, app_factory)


def cmd_extract(args: argparse.Namespace) -> int:
    """``stencil extract``: documents to objects of a schema, through ``stencil batch``'s machinery."""
    from stencil.service import extract_cli

    return cmd_batch(args, extract_cli.main)


# Benchmarks whose module is not named after the command.
BENCHMARK_MODULES = {"maskbench": "maskbench_harness", "peers": "peers.run"}


def benchmark_module(name: str) -> str:
    """The module (``stencil.benchmarks.X``) that ``stencil bench NAME`` runs."""
    return f"stencil.benchmarks.{BENCHMARK_MODULES.get(name, name)}"


def cmd_bench(args: argparse.Namespace) -> int:
    name = args.name
    try:
        module = importlib.import_module(benchmark_module(name))
    except ModuleNotFoundError as e:
        if e.name not in (benchmark_module(name), "benchmarks"):
            raise  # the benchmark exists but one of its own imports is missing: show that
        known = ", ".join(sorted(BENCHMARKS))
        print(f"stencil bench: benchmark {name!r} is not available (no module {benchmark_module(name)}); "
              f"known: {known}", file=sys.stderr)
        return 2
    if not (hasattr(module, "add_arguments") and hasattr(module, "main")):
        print(f"stencil bench: {benchmark_module(name)} has no add_arguments/main", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"stencil bench {name}",
                                     description=BENCHMARKS.get(name, module.__doc__))
    module.add_arguments(parser)
    rc = module.main(parser.parse_args(args.bench_args))
    return int(rc or 0)


def _file_command(sub, name: str, add_arguments, func, **texts: str) -> None:
    """A subcommand that runs a file of requests through the engine (``batch``, ``extract``): its own
    arguments, then the engine's and the service's, every default shown."""
    p = sub.add_parser(name, **texts)
    add_arguments(p)
    _add_engine_args(p)
    _add_service_args(p)
    _show_defaults(p)
    p.set_defaults(func=func)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` say every option's default: appended to its help (or as its help) where the
    text does not already name one; options whose default is None or off say nothing."""
    for action in parser._actions:  # argparse keeps no public list of them
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS):
            continue
        if action.help is None:
            action.help = "default: %(default)s"
        elif "default" not in action.help:
            action.help += " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stencil", description="Stencil: structured-generation LLM service.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the HTTP API", description="Serve POST /generate, the OpenAI-"
                       "compatible API, /health and /metrics. SIGTERM drains and exits 0; if the engine "
                       "dies the process exits 1.")
    _add_engine_args(p)
    _add_service_args(p)
    _add_connection_args(p)
    _add_cluster_args(p)
    _show_defaults(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="one constrained generation, in process",
                       description="Load the model, generate once, print the result on stdout "
                                   "(progress on stderr). Exit 0 when the output is valid.")
    p.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--schema", type=Path, default=None, help="JSON Schema file the output must match")
    c.add_argument("--regex", default=None, help="regex the whole output must match")
    p.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template (always so "
                   "for a model without one)")
    p.add_argument("--parse-special-tokens", action="store_true",
                   help="with --raw: parse control-token text in PROMPT (<|im_end|>, ...) into control tokens "
                        "(default: plain text)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    _add_engine_args(p)
    _show_defaults(p)
    p.set_defaults(func=cmd_generate)

    from stencil.service import batch, extract_cli

    _file_command(sub, "batch", batch.add_arguments, cmd_batch,
                  help="answer a file of OpenAI batch lines (resumable)",
                  description="Send each line of INPUT.jsonl (OpenAI's batch format: custom_id, method, url, body) "
                              "through the server's routes, in process or to --url, and append each answer to "
                              "OUTPUT.jsonl as it comes; a rerun skips what OUTPUT holds. docs/serving.md, "
                              "'Batch files'.")
    _file_command(sub, "extract", extract_cli.add_arguments, cmd_extract,
                  help="documents to JSON objects of a schema or type, to JSONL or CSV",
                  description="Extract one object of --schema/--type from each document of --input (a JSONL "
                              "file, a folder of .txt/.md files, or stdin) into --output, through stencil batch's "
                              "machinery (in process or --url; resumable). "
                              "docs/serving.md, 'Extraction from the command line'.")

    p = sub.add_parser("bench", help="run a benchmark",
                       description="Benchmarks: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items())
                       + ". `stencil bench NAME --help` shows a benchmark's options.")
    p.add_argument("name", help="one of: " + ", ".join(BENCHMARKS))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stencil`` console script; returns the exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stencil.engine.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelArgError, ConfigError) as e:  # one line, no traceback: a path or a value we cannot serve
        print(f"stencil {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
