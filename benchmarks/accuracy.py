"""``stencil bench accuracy``: how often the extracted fields are right, per JSON layout.

``stencil bench accuracy [--items 48] [--workloads person,extraction] [--modes compact,flexible,unconstrained]
[--base-url URL ...] --json PATH``

Items come from ``stencil.benchmarks.workload`` with their planted answers: ``person_items`` (one
sentence, name/age/city, the requests of the latency comparison) and ``extraction_items``
(documents of 150-400 tokens, four schemas). Each item is generated greedily, on the default
model in process, once per mode:

* ``compact`` / ``flexible``: constrained by the item's schema with that whitespace mode
  (``GrammarSpec.json_schema(schema, whitespace=...)``, exactly what the service compiles);
* ``unconstrained``: no grammar, the text parsed afterwards: the first JSON object in it
  (inside a code fence or not), as a client that asks nicely and parses would do.

Per mode: ``valid_fraction`` (the output is JSON that the schema accepts, jsonschema with
formats), ``parsed_fraction`` (an object could be read at all), ``field_accuracy`` (fields equal
to the planted value over all planted fields; a missing or unparsable answer scores 0 on each of
its fields), ``exact_fraction`` (every field right), per field and per kind, mean output tokens,
answers cut at ``max_tokens`` and answers the budget closed early.

``--base-url`` (repeatable, loopback only) sends the same items to an OpenAI-compatible server
(``llama-server``, ``stencil serve``, vLLM) as chat requests with ``bench serve``'s body
(``response_format: json_schema``, strict, greedy), mode ``json_schema``, and without a
response format, mode ``unconstrained``; the layout is the server's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

from stencil.benchmarks.common import make_validator

LOCAL_MODES = ("compact", "flexible", "unconstrained")
SERVER_MODES = ("json_schema", "unconstrained")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True, help="where to write the report")
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file, a directory with one, or an HF model directory (default: SmolLM2-135M)")
    p.add_argument("--items", type=int, default=48, help="items per workload")
    p.add_argument("--workloads", default="person,extraction", help="comma-separated: person, extraction")
    p.add_argument("--modes", default=",".join(LOCAL_MODES),
                   help="in-process modes: compact, flexible, unconstrained (empty: none)")
    p.add_argument("--max-tokens", type=int, default=160, help="per answer; unconstrained answers get 2x")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--base-url", action="append", default=[],
                   help="also ask this OpenAI-compatible server (loopback); repeatable")
    p.add_argument("--server-model", default=None, help="model id for --base-url (default: its first)")
    p.add_argument("--server-concurrency", type=int, default=4, help="requests in flight per server")
    p.add_argument("--api-key", default="none")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per server request")


# -- scoring ---------------------------------------------------------------------------------------

def first_json_object(text: str) -> dict | None:
    """The first JSON object in ``text`` (a code fence, prose around it, pretty or compact), or None."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


def field_matches(got: object, want: object) -> bool:
    """Exact match of one field: strings by equality (no case folding, no trimming), numbers
    by value (``42 == 42.0``, never ``True == 1``), lists element by element."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and got == want
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(field_matches, got, want))
    return got == want


def score(items, texts: list[str], *, parse_loose: bool) -> list[dict]:
    """Per item: ``parsed``, ``valid`` and ``fields`` (name → right?) of its output text.

    ``parse_loose``: read the first JSON object anywhere in the text (unconstrained answers);
    else the whole text must be one JSON document (a constrained answer is nothing else).
    """
    validators: dict[int, object] = {}
    out = []
    for it, text in zip(items, texts):
        if parse_loose:
            doc = first_json_object(text)
        else:
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
        validator = validators.setdefault(id(it.schema), make_validator(it.schema))
        valid = doc is not None and validator.is_valid(doc)
        got = doc if isinstance(doc, dict) else {}
        out.append({"parsed": isinstance(doc, dict), "valid": valid,
                    "fields": {k: k in got and field_matches(got[k], v) for k, v in it.answer.items()}})
    return out


def summarize_scores(items, scores: list[dict], extra: list[dict]) -> dict:
    """Fractions over the items: valid, parsed, field accuracy, exact; per field and per kind."""
    n = len(scores)
    fields = [ok for s in scores for ok in s["fields"].values()]
    per_field: dict[str, list[bool]] = defaultdict(list)
    per_kind: dict[str, list[bool]] = defaultdict(list)
    for it, s in zip(items, scores):
        for k, ok in s["fields"].items():
            per_field[f"{it.kind}.{k}"].append(ok)
            per_kind[it.kind].append(ok)
    return {
        "items": n,
        "valid_fraction": sum(s["valid"] for s in scores) / n if n else None,
        "parsed_fraction": sum(s["parsed"] for s in scores) / n if n else None,
        "field_accuracy": sum(fields) / len(fields) if fields else None,
        "exact_fraction": sum(all(s["fields"].values()) for s in scores) / n if n else None,
        "per_field": {k: sum(v) / len(v) for k, v in sorted(per_field.items())},
        "per_kind": {k: sum(v) / len(v) for k, v in sorted(per_kind.items())},
        "mean_output_tokens": (sum(e["tokens"] for e in extra) / n) if n and extra else None,
        "cut_at_max_tokens": sum(e.get("finish_reason") == "length" for e in extra),
        "closed_by_budget": sum(bool(e.get("closed_by_budget")) for e in extra),
    }


# -- in process ------------------------------------------------------------------------------------

def run_local(engine, items, mode: str, max_tokens: int) -> tuple[list[str], list[dict], float]:
    """Greedy outputs of ``items`` under ``mode``; (texts, per-item extras, wall seconds).

    All items go to the engine at once: greedy outputs do not depend on batching (the engine's
    invariant), and the run takes a fraction of the time.
    """
    from stencil.engine.request import SamplingParams
    from stencil.grammar.base import GrammarSpec

    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(it.messages(), add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for it in items]
    if mode == "unconstrained":
        grammars, params = None, SamplingParams(max_tokens=2 * max_tokens, temperature=0)
    else:
        compiled = {}
        for it in items:
            key = json.dumps(it.schema, sort_keys=True)
            if key not in compiled:
                compiled[key] = engine.grammar.compile(GrammarSpec.json_schema(it.schema, whitespace=mode))
        grammars = [compiled[json.dumps(it.schema, sort_keys=True)] for it in items]
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, grammars)
    wall = time.perf_counter() - t0
    extra = [{"tokens": len(r["token_ids"]), "finish_reason": r["finish_reason"],
              "closed_by_budget": bool(r["output"] and r["output"].closed_by_budget)} for r in results]
    return [r["text"] for r in results], extra, wall


# -- over HTTP -------------------------------------------------------------------------------------

async def run_server(root: str, model: str, items, mode: str, max_tokens: int, concurrency: int,
                     api_key: str, timeout: float) -> tuple[list[str], list[dict], float, list[str]]:
    """Non-streamed chat requests for ``items``; (texts, extras, wall seconds, errors)."""
    import httpx

    from stencil.benchmarks.serve import Job, request_body

    texts: list[str] = [""] * len(items)
    extra: list[dict] = [{"tokens": 0}] * len(items)
    errors: list[str] = []
    pending = list(range(len(items)))
    async with httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}) as http:
        async def worker() -> None:
            while pending:
                i = pending.pop(0)
                it = items[i]
                body = request_body(Job(it.messages(), it.schema), model, max_tokens, stream=False)
                if mode == "unconstrained":
                    del body["response_format"]
                    body["max_tokens"] = 2 * max_tokens
                try:
                    r = await http.post(root + "/chat/completions", json=body)
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                    continue
                if r.status_code != 200:
                    errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                data = r.json()
                choice = data["choices"][0]
                texts[i] = choice["message"].get("content") or ""
                extra[i] = {"tokens": (data.get("usage") or {}).get("completion_tokens") or 0,
                            "finish_reason": choice.get("finish_reason"),
                            "closed_by_budget": bool(choice.get("closed_by_budget"))}

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return texts, extra, time.perf_counter() - t0, errors


# -- the command -----------------------------------------------------------------------------------

def workload_items(names: list[str], n: int) -> tuple[list, list[str]]:
    """The items of the named workloads (``person``, ``extraction``), ``n`` of each, and the
    workload of each item."""
    from stencil.benchmarks.workload import extraction_items, person_items

    makers = {"person": person_items, "extraction": extraction_items}
    unknown = [w for w in names if w not in makers]
    if unknown:
        raise SystemExit(f"stencil bench accuracy: unknown workload(s) {unknown}; known: {sorted(makers)}")
    return [it for w in names for it in makers[w](n, seed=3)], [w for w in names for _ in range(n)]


def _print(label: str, s: dict) -> None:
    print(f"[accuracy] {label}: fields {s['field_accuracy']:.3f}, exact {s['exact_fraction']:.3f}, "
          f"valid {s['valid_fraction']:.3f}, parsed {s['parsed_fraction']:.3f}, "
          f"tokens {s['mean_output_tokens'] or 0:.1f}, cut {s['cut_at_max_tokens']}, "
          f"closed by budget {s['closed_by_budget']}", flush=True)


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.serve import NotLoopback, served_model, v1_root

    workloads = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in LOCAL_MODES]
    if bad:
        print(f"stencil bench accuracy: unknown mode(s) {bad}; known: {', '.join(LOCAL_MODES)}")
        return 2
    try:
        roots = [v1_root(u) for u in args.base_url]
    except NotLoopback as e:
        print(f"stencil bench accuracy: {e}")
        return 2
    items, groups = workload_items(workloads, args.items)
    report: dict = {"workloads": workloads, "items_per_workload": args.items, "max_tokens": args.max_tokens,
                    "seed": 3, "stencil": {}, "servers": {}}
    if modes:
        from stencil.engine.config import EngineConfig
        from stencil.engine.llm_engine import LLMEngine
        from stencil.engine.models.default_model import ensure_default_model

        model = args.model or ensure_default_model()
        engine = LLMEngine(EngineConfig(model=model, num_threads=args.threads, max_num_seqs=64))
        report["model"] = str(model)
        for mode in modes:
            texts, extra, wall = run_local(engine, items, mode, args.max_tokens)
            scores = score(items, texts, parse_loose=mode == "unconstrained")
            s = summarize_scores(items, scores, extra)
            s["wall_s"] = wall
            s["by_workload"] = {w: summarize_scores(*_subset(groups, w, items, scores, extra)) for w in workloads}
            s["samples"] = texts[:3]
            report["stencil"][mode] = s
            _print(f"stencil {mode}", s)
        del engine
    for url, root in zip(args.base_url, roots):
        model_id = args.server_model or served_model(root, args.api_key)
        per: dict = {"model": model_id}
        for mode in SERVER_MODES:
            texts, extra, wall, errors = asyncio.run(run_server(root, model_id, items, mode, args.max_tokens,
                                                                args.server_concurrency, args.api_key,
                                                                args.timeout))
            scores = score(items, texts, parse_loose=mode == "unconstrained")
            s = summarize_scores(items, scores, extra)
            s.update(wall_s=wall, errors=len(errors), first_error=errors[0] if errors else None,
                     by_workload={w: summarize_scores(*_subset(groups, w, items, scores, extra)) for w in workloads},
                     samples=texts[:3])
            per[mode] = s
            _print(f"{url} {mode}", s)
        report["servers"][url] = per
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print(f"wrote {args.json}")
    return 0


def _subset(groups: list[str], workload: str, *columns: list) -> list[list]:
    """The entries of each of ``columns`` that belong to ``workload``."""
    return [[c[i] for i, g in enumerate(groups) if g == workload] for c in columns]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
