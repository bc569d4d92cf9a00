"""``stencil bench serve``: the throughput workload against any OpenAI-compatible server over HTTP.

``stencil bench serve --base-url URL [--base-url URL2] [--model M] [--concurrency 1,8,32] --json PATH``

The extraction workload of ``bench throughput`` (``stencil.benchmarks.workload``: documents of 150-400
tokens, a JSON Schema each) is sent as OpenAI chat requests, ``response_format: json_schema``
(``strict: true``), greedy, streamed, to a running server — Stencil (``stencil serve``),
llama.cpp's ``llama-server``, vLLM — closed loop at each concurrency (``C`` requests in
flight), and reported with the keys of ``bench throughput``: output tokens/s, requests/s, TTFT
and ITL p50/p99 (ms), the whole request's latency p50/p99 (ms, send to the end of the stream),
valid fraction (jsonschema on each answer), plus errors. Given two ``--base-url``s, both run
the same workload in this one run (alternating per concurrency level) and the report gives the
ratios of the first's output tokens/s and requests/s to the second's. A PNG goes next to the
JSON. ``--workload person`` sends one-sentence name/age/city chats of about 40 prompt tokens
instead (``stencil.benchmarks.workload.person_items``), the interactive case of
``stencil bench peers``. ``--api completions`` sends the same items as ``/v1/completions`` text
prompts (``completion_prompt``: an instruction, the sentence or document, ``JSON:``), for base
models without a chat template; the constraint goes as ``response_format`` to OpenAI-style
servers and as llama.cpp's own top-level ``json_schema`` to a ``llama-server`` (its
``/v1/completions`` ignores ``response_format``), told apart by its ``/props``. Items with a known
answer are scored field by field (``field_accuracy``, as ``stencil bench accuracy`` scores).

Measured from the client: TTFT from sending the request to the first content chunk (HTTP,
templating, tokenizing and the grammar compile included, which ``bench throughput``, timing
from the engine's entry, leaves out); ITL from the gaps between content chunks, each gap split
evenly over the tokens its chunk carries, counted from the chunk's ``logprobs`` (asked for;
one token per chunk when a server sends none), and output tokens from the final ``usage``
chunk when the server sends one. Each schema is sent once before timing, so grammar compiles
that a server caches are not timed. ``bench throughput`` empties the prefix cache between
concurrency levels; a server's cache cannot be emptied over HTTP, so each level's system message
starts with its own tag (``[run c=8]``): the documents are not served from the cache of an
earlier level (or of the warm-up).

Only loopback addresses (127.0.0.0/8, ::1, localhost) are contacted; others are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from stencil.benchmarks.common import Trace, is_valid, make_validator, pct, summarize

LOOPBACK_NAMES = ("localhost",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", action="append", required=True,
                   help="server root (http://127.0.0.1:PORT, with or without /v1); give twice to compare two")
    p.add_argument("--model", default=None, help="model id to ask for (default: the server's first /v1/models)")
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default: next to --json)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--api-key", default="none", help="sent as a bearer token")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    p.add_argument("--workload", choices=("extraction", "person"), default="extraction",
                   help="extraction: documents of 150-400 tokens, four schemas; person: one-sentence "
                        "name/age/city chats of about 40 tokens (the peers comparison)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="chat: /v1/chat/completions with messages; completions: /v1/completions with a text "
                        "prompt (base models without a chat template)")


class NotLoopback(ValueError):
    """A URL whose host is not a loopback address."""


def v1_root(url: str) -> str:
    """The server's ``/v1`` root (``http://127.0.0.1:8000`` and ``.../v1`` alike).

    Raises:
        NotLoopback: the host is not 127.0.0.0/8, ::1 or localhost.
    """
    parsed = httpx.URL(url)
    host = parsed.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if parsed.scheme not in ("http", "https") or not loopback:
        raise NotLoopback(f"{url!r}: stencil bench serve only contacts loopback servers (127.0.0.1, ::1, "
                          "localhost); start the server on this machine or tunnel it to a local port")
    root = str(parsed).rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


@dataclass(slots=True)
class Job:
    """One request of the workload.

    Attributes:
        messages: the chat (``--api chat``).
        schema: the JSON Schema of the answer.
        answer: the right answer field by field (scored), or None.
        prompt: the text prompt (``--api completions``), or None.
    """

    messages: list[dict]
    schema: dict
    answer: dict | None = None
    prompt: str | None = None


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one server is asked: which endpoint, and where a completion's JSON Schema goes.

    Attributes:
        api: ``chat`` (``/chat/completions``) or ``completions`` (``/completions``).
        llama_cpp: the server is llama.cpp's ``llama-server`` (its ``/v1/completions`` reads the
            top-level ``json_schema`` and ignores ``response_format``).
    """

    api: str = "chat"
    llama_cpp: bool = False


COMPLETION_INSTRUCTION = "Extract the facts of the text below as one JSON object with the fields: {fields}."


def completion_prompt(instruction: str | None, document: str, fields: list[str]) -> str:
    """The text prompt of one item for a base model: the instruction, the text, then ``JSON:``."""
    head = instruction or COMPLETION_INSTRUCTION.format(fields=", ".join(fields))
    return f"{head}\n\nText: {document}\n\nJSON:"


def tagged(job: Job, tag: str) -> Job:
    """``job`` with ``tag`` at the start of its prompt (a different prompt prefix)."""
    first = {**job.messages[0], "content": f"{tag} {job.messages[0]['content']}"}
    prompt = None if job.prompt is None else f"{tag} {job.prompt}"
    return Job([first, *job.messages[1:]], job.schema, job.answer, prompt)


def request_body(job: Job, model: str, max_tokens: int, stream: bool = True,
                 dialect: Dialect = Dialect()) -> dict:
    """The OpenAI request of one workload item: a chat, or a completion (``dialect.api``)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "extraction", "schema": job.schema, "strict": True}}
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if dialect.api == "chat":
        body.update(messages=job.messages, response_format=fmt)
    elif dialect.llama_cpp:
        body.update(prompt=job.prompt, json_schema=job.schema)
    else:
        body.update(prompt=job.prompt, response_format=fmt)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        if dialect.api == "chat":
            body.update(logprobs=True)
    return body


def server_dialect(root: str, api: str, api_key: str) -> Dialect:
    """The dialect of the server at ``root`` (its ``/v1`` root): llama.cpp answers ``GET /props``
    with its ``default_generation_settings``; anything else is taken as OpenAI-compatible."""
    try:
        r = httpx.get(root.removesuffix("/v1") + "/props", headers={"Authorization": f"Bearer {api_key}"},
                      timeout=30)
        llama = r.status_code == 200 and "default_generation_settings" in r.json()
    except (httpx.HTTPError, ValueError):
        llama = False
    return Dialect(api, llama)


async def one_request(http: httpx.AsyncClient, root: str, body: dict) -> tuple[Trace, int | None, str | None]:
    """Send one streamed request (a chat when ``body`` has ``messages``, else a completion); (its
    trace with the text, usage's completion tokens, error). The trace's ``done`` is when the
    stream ended (``[DONE]`` or the connection's end)."""
    trace = Trace(submit=time.perf_counter())
    usage = None
    path = "/chat/completions" if "messages" in body else "/completions"
    async with http.stream("POST", root + path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return trace, None, f"HTTP {resp.status_code}: {resp.text[:200]}"
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                return trace, None, str(chunk["error"])[:200]
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                lps = ((choice.get("logprobs") or {}).get("content")) or []
                if not text and not lps:
                    continue
                now = time.perf_counter()
                n = len(lps) or 1
                trace.add(now, n)
                trace.token_ids.extend([0] * n)
                trace.text += text
                if choice.get("finish_reason"):
                    trace.finish_reason = choice["finish_reason"]
    trace.done = time.perf_counter()
    return trace, usage, None


async def run_level(root: str, model: str, jobs: list[Job], concurrency: int, max_tokens: int,
                    api_key: str, timeout: float, dialect: Dialect = Dialect()) -> dict:
    """Closed loop: ``concurrency`` requests in flight until every job is answered."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                 headers={"Authorization": f"Bearer {api_key}"}) as http:
        pending = list(range(len(jobs)))
        traces: list[Trace | None] = [None] * len(jobs)
        usages: list[int | None] = [None] * len(jobs)
        errors: list[str] = []

        async def worker() -> None:
            while pending:
                i = pending.pop(0)
                try:
                    trace, usage, err = await one_request(http, root, request_body(jobs[i], model, max_tokens,
                                                                                   dialect=dialect))
                except httpx.HTTPError as e:
                    trace, usage, err = Trace(submit=time.perf_counter()), None, repr(e)
                traces[i], usages[i] = trace, usage
                if err:
                    errors.append(err)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    validators: dict[int, object] = {}
    valid = [is_valid(t.text, validators.setdefault(id(j.schema), make_validator(j.schema)))
             for t, j in zip(traces, jobs)]
    for t, u in zip(traces, usages):
        if u and t.token_times and u != len(t.token_times):
            # The server's chunks did not say how many tokens they carried (no logprobs): trust
            # its usage and spread the tokens over the chunks' arrival times.
            t.token_times = _stretch(t.token_times, u)
            t.token_ids = [0] * u
    out = summarize(traces, wall, valid)  # type: ignore[arg-type]
    latencies = [(t.done - t.submit) * 1e3 for t in traces if t is not None and t.done is not None]
    out["latency_ms_p50"], out["latency_ms_p99"] = pct(latencies, 50), pct(latencies, 99)
    out["field_accuracy"] = field_accuracy(jobs, traces)
    out["errors"] = len(errors)
    if errors:
        out["first_error"] = errors[0]
    return out


def field_accuracy(jobs: list[Job], traces: list) -> float | None:
    """The fraction of known answer fields that the answers got right (``accuracy.field_matches``;
    an answer that is not one JSON object gets none of its fields), or None without answers."""
    from stencil.benchmarks.accuracy import field_matches

    right = total = 0
    for job, trace in zip(jobs, traces):
        if not job.answer:
            continue
        try:
            doc = json.loads(trace.text) if trace is not None else None
        except ValueError:
            doc = None
        got = doc if isinstance(doc, dict) else {}
        total += len(job.answer)
        right += sum(k in got and field_matches(got[k], v) for k, v in job.answer.items())
    return right / total if total else None


def _stretch(times: list[float], n: int) -> list[float]:
    """``n`` arrival times spread over the chunk arrivals ``times`` (in order)."""
    return [times[min(int(k * len(times) / n), len(times) - 1)] for k in range(n)]


async def warm(root: str, model: str, jobs: list[Job], api_key: str, timeout: float, max_tokens: int,
               dialect: Dialect = Dialect()) -> None:
    """One request per distinct schema, so cached grammar compiles are not timed. It asks for the
    run's ``max_tokens``: a constrained request with less room than its shortest answer is refused
    (Stencil's budget check)."""
    seen: set[str] = set()
    async with httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for job in jobs:
            key = json.dumps(job.schema, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            body = request_body(job, model, max_tokens, stream=False, dialect=dialect)
            r = await http.post(root + ("/chat/completions" if dialect.api == "chat" else "/completions"), json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{root}: warm-up request refused with HTTP {r.status_code}: {r.text[:300]}")


def served_model(root: str, api_key: str) -> str:
    r = httpx.get(root + "/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["throughput"]
    urls = report["base_urls"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(len(rows)))
    width = 0.8 / len(urls)
    for k, url in enumerate(urls):
        off = [i - 0.4 + width * (k + 0.5) for i in x]
        axes[0].bar(off, [r["results"][url]["output_tokens_per_s"] or 0 for r in rows], width, label=url)
        axes[1].bar(off, [r["results"][url]["ttft_ms_p50"] or 0 for r in rows], width, label=url)
    for ax, label in ((axes[0], "output tokens/s"), (axes[1], "TTFT p50 (ms)")):
        ax.set_xticks(x, [str(r["concurrency"]) for r in rows])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[0].set_title("Structured extraction over HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def workload_jobs(name: str, n: int) -> tuple[list[Job], str]:
    """``n`` jobs of the named workload (each with its chat and its text prompt), and how the
    report names it."""
    from stencil.benchmarks.workload import extraction_items, person_items

    items, made_by = ((person_items(n, seed=1), "stencil.benchmarks.workload.person_items(seed=1)") if name == "person"
                      else (extraction_items(n, seed=1), "stencil.benchmarks.workload.extraction_items(seed=1)"))
    return [Job(it.messages(), it.schema, it.answer or None,
                completion_prompt(it.instruction, it.document, list(it.schema["properties"])))
            for it in items], made_by


def main(args: argparse.Namespace) -> int:

    try:
        roots = [v1_root(u) for u in args.base_url]
    except NotLoopback as e:
        print(f"stencil bench serve: {e}")
        return 2
    if len(roots) > 2:
        print("stencil bench serve: give one or two --base-url")
        return 2
    models = [args.model or served_model(r, args.api_key) for r in roots]
    dialects = [server_dialect(r, args.api, args.api_key) for r in roots]
    jobs, workload = workload_jobs(args.workload, args.requests)
    levels = [int(c) for c in args.concurrency.split(",")]
    for root, model, dialect in zip(roots, models, dialects):
        asyncio.run(warm(root, model, jobs, args.api_key, args.timeout, args.max_tokens, dialect))
    rows = []
    for c in levels:
        row: dict = {"concurrency": c, "results": {}}
        for url, root, model, dialect in zip(args.base_url, roots, models, dialects):
            level_jobs = [tagged(j, f"[run c={c}]") for j in jobs]
            s = asyncio.run(run_level(root, model, level_jobs, c, args.max_tokens, args.api_key, args.timeout,
                                      dialect))
            row["results"][url] = s
            print(f"[serve] {url} c={c} {s['output_tokens_per_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, "
                  f"latency p50 {s['latency_ms_p50'] or 0:.0f} ms, "
                  f"TTFT p50 {s['ttft_ms_p50'] or 0:.0f} ms, ITL p50 {s['itl_ms_p50'] or 0:.1f} ms, "
                  f"valid {s['valid_fraction']:.2f}, fields {s['field_accuracy'] or 0:.2f}, "
                  f"errors {s['errors']}", flush=True)
        if len(roots) == 2:
            a, b = (row["results"][u]["output_tokens_per_s"] for u in args.base_url)
            row["ratio_output_tokens_per_s"] = a / b if a and b else None
            a, b = (row["results"][u]["requests_per_s"] for u in args.base_url)
            row["ratio_requests_per_s"] = a / b if a and b else None
        rows.append(row)
    report = {"base_urls": list(args.base_url), "models": models, "requests": args.requests,
              "max_tokens": args.max_tokens, "workload": workload, "api": args.api,
              "llama_cpp": [d.llama_cpp for d in dialects],
              "throughput": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    plot(report, args.plot or args.json.with_suffix(".png"))
    print(f"wrote {args.json}")
    errors = sum(r["results"][u]["errors"] for r in rows for u in args.base_url)
    return 1 if errors else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
