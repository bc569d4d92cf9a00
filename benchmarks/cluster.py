"""Replicas on Ray Serve: prefix-affinity routing against round-robin (and Ray's own prefix
router), then a replica killed under load. Loopback only, inside a private network namespace.

``stencil bench cluster --replicas 2 [--model DIR|tiny] --json PATH``

One run, one Ray instance. For each router (``--routers``, default ``round_robin,ray_prefix,
affinity``) the Serve application is deployed afresh (cold caches), the same shared-prefix
workload is sent over HTTP (``--prompts`` long system prompts, ``--users`` questions each,
shuffled, ``--concurrency`` streams at once, greedy), and the run reports the replicas'
prefix-cache hit rate over the run (their counters before and after), client-side TTFT p50/p99
(request sent → first text event), output tokens/s, errors and the per-replica request split.
Every router's outputs are compared request by request (``outputs_identical``).

Each replica's KV cache is sized (``--num-kv-blocks``) to hold about half of the system
prompts: the regime where routing matters. Round-robin makes every replica hold every prompt,
so they evict each other; affinity gives each replica its own share.

Then, on the last deployment, ``--kill-requests`` requests of the same workload are sent again
and, once a quarter of them are answered, the replica serving the next request to start
streaming (its ``X-Stencil-Replica`` header) is killed (SIGKILL); ``replica_kill``
counts what was sent, answered, lost (an error or no answer) and wrong (an answer that differs
from the earlier runs), the ingress's retries and replays, and how long after the kill Serve had
the replica back.
A quick check of the API on the cluster (``api``) comes first: /health lists the replicas,
/metrics has per-replica series, a bad schema on a stream is a 400, the OpenAI route answers.

Ray opens ports on all interfaces, so the benchmark re-executes itself under ``unshare -n``
(a new network namespace with only loopback; needs root or user namespaces), unless it is
already inside one (``STENCIL_PRIVATE_NETNS=1``). Figures on a shared CPU are provisional.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from stencil.benchmarks.common import pct
from stencil.benchmarks.workload import COMPANIES, FILLER, FIRST, PRODUCTS

NETNS_ENV = "STENCIL_PRIVATE_NETNS"
QUESTIONS = ["Can I return the {p} after thirty days?", "Does the {p} come with a warranty?",
             "How long does delivery of the {p} take?", "Is there a discount on a second {p}?",
             "Where can I find the manual for the {p}?", "Can the {p} be repaired locally?",
             "What colours does the {p} come in?", "Is the {p} safe to use outdoors?"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="engine replicas")
    p.add_argument("--model", default=None, help="model directory, or 'tiny' (default: the default model)")
    p.add_argument("--routers", default="round_robin,ray_prefix,affinity",
                   help="routers to compare, comma-separated (stencil.service.cluster.ROUTERS); the last one "
                        "also serves the replica-kill phase")
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    p.add_argument("--users", type=int, default=6, help="requests per system prompt")
    p.add_argument("--prompt-sentences", type=int, default=30, help="sentences per system prompt (~14 tokens each)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per replica (default: room for about half the system prompts)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--kill-requests", type=int, default=32, help="requests of the replica-kill phase (0: skip)")
    p.add_argument("--restart-timeout", type=float, default=600.0,
                   help="longest wait for the replica's return (s; with both cores busy it took over 180 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the report here")


# -- the workload ----------------------------------------------------------------------------------

def shared_prefix_workload(n_prompts: int, users: int, sentences: int, seed: int = 0) -> list[dict]:
    """``n_prompts * users`` chat requests: a long system prompt each, a short user question;
    shuffled, so requests sharing a prompt arrive interleaved with the others."""
    rng = random.Random(seed)
    systems = []
    for i in range(n_prompts):
        company, product = COMPANIES[i % len(COMPANIES)], PRODUCTS[i % len(PRODUCTS)]
        body = " ".join(rng.sample(FILLER, min(sentences, len(FILLER))) +
                        [rng.choice(FILLER) for _ in range(max(0, sentences - len(FILLER)))])
        systems.append((f"{company} #{i} support desk. You answer questions about our {product}. "
                        f"House notes follow. {body}", product))
    out = []
    for i, (system, product) in enumerate(systems):
        for u in range(users):
            q = QUESTIONS[(i + u) % len(QUESTIONS)].format(p=product)
            out.append({"prompt_index": i, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{FIRST[(i * users + u) % len(FIRST)]} asks: {q}"}]})
    rng.shuffle(out)
    return out


@dataclass(slots=True)
class Result:
    """One request as the client saw it (times: ``time.perf_counter`` seconds)."""

    index: int
    sent: float
    first: float | None = None
    text: str = ""
    tokens: int = 0
    status: int | None = None
    error: str | None = None


async def _one(client: httpx.AsyncClient, index: int, body: dict, on_first=None) -> Result:
    r = Result(index, time.perf_counter())
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:300]
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["type"] == "delta":
                    if r.first is None and event["text"]:
                        r.first = time.perf_counter()
                        if on_first is not None:
                            await on_first(resp.headers.get("x-stencil-replica"))
                    r.text += event["text"]
                elif event["type"] == "final":
                    r.tokens = event["usage"]["completion_tokens"]
                else:
                    r.error = json.dumps(event)[:300]
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    if r.error is None and r.tokens == 0 and not r.text:
        r.error = "no final event"
    return r


async def run_load(url: str, bodies: list[dict], concurrency: int, on_first=None,
                   results: list[Result] | None = None) -> tuple[list[Result], float]:
    """Send ``bodies`` (``/generate`` streams) keeping ``concurrency`` in flight; (results in
    ``bodies`` order, wall s).

    ``on_first(replica)`` is awaited when a stream's first text arrives (``replica``: its
    ``X-Stencil-Replica`` header); ``results`` collects answers as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, b in enumerate(bodies):
        queue.put_nowait((i, b))
    results = [] if results is None else results
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i, b = queue.get_nowait()
                results.append(await _one(client, i, b, on_first))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


# -- the cluster -----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def _wait_replicas(url: str, n: int, timeout_s: float, exclude: set[str] = frozenset()) -> float:
    """Seconds until /health lists ``n`` replicas "ok" (none of ``exclude``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            reps = _health(url).get("replicas") or []
            ok = [r for r in reps if r.get("status") == "ok" and r.get("replica") not in exclude]
            if len(ok) >= n:
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas were not up within {timeout_s:.0f} s")


def _replica_counters(url: str) -> dict[str, dict]:
    return {r["replica"]: {"queries": r["engine"]["prefix_cache_queries"], "hits": r["engine"]["prefix_cache_hits"],
                           "admitted": r["admitted"]}
            for r in _health(url).get("replicas") or [] if r.get("status") == "ok"}


def _summary(results: list[Result], wall_s: float, before: dict, after: dict) -> dict:
    ttfts = [(r.first - r.sent) * 1e3 for r in results if r.first is not None]
    queries = sum(after[k]["queries"] - before.get(k, {}).get("queries", 0) for k in after)
    hits = sum(after[k]["hits"] - before.get(k, {}).get("hits", 0) for k in after)
    tokens = sum(r.tokens for r in results if r.error is None)
    return {
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p99": pct(ttfts, 99),
        "output_tokens_per_s": tokens / wall_s if wall_s else None,
        "errors": sum(1 for r in results if r.error is not None),
        "requests": len(results), "wall_s": round(wall_s, 2),
        "requests_per_replica": sorted((after[k]["admitted"] - before.get(k, {}).get("admitted", 0) for k in after),
                                       reverse=True),
        "error_examples": [r.error for r in results if r.error][:3],
    }


def _api_checks(url: str, model_name: str) -> dict:
    """A few answers of the cluster's API, as booleans (the test asserts them)."""
    h = _health(url)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    bad = httpx.post(url + "/generate", timeout=60, json={"prompt": "x", "stream": True,
                                                           "response_schema": {"type": "object", "not": {}}})
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model_name, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0})
    schema = httpx.post(url + "/generate", timeout=120, json={
        "prompt": "Count:", "response_schema": {"type": "integer"}, "max_tokens": 6})
    return {
        "health_lists_replicas": len([r for r in h.get("replicas") or [] if r.get("status") == "ok"]),
        "metrics_per_replica": metrics.count("stencil_replica_up{"),
        "bad_schema_stream_status": bad.status_code,
        "chat_status": chat.status_code,
        "schema_status": schema.status_code,
        "schema_finish": schema.json().get("finish_reason") if schema.status_code == 200 else None,
    }


def _kill_phase(url: str, bodies: list[dict], reference: dict[int, str], args) -> dict:
    """Kill the replica serving a request that is streaming, once a quarter of ``bodies`` are
    answered: that request, and whatever else ran there, must still be answered, unchanged."""
    killed: dict = {}
    answered_before = max(1, len(bodies) // 4)
    done: list[Result] = []
    # Replica pids read before the load: the kill must land while the victim's request still
    # streams. A /health round trip at the first token took longer than the tiny model's whole
    # answer once replicas ran at full priority (the stream had ended: nothing to replay).
    pids = {r.get("replica"): r.get("pid") for r in _health(url).get("replicas") or []}

    async def on_first(replica: str | None) -> None:
        if killed or replica is None or len(done) < answered_before:
            return
        pid = pids.get(replica)
        if pid is None:  # not in the stats poll before the load: ask again
            pid = next((r.get("pid") for r in _health(url).get("replicas") or [] if r.get("replica") == replica), None)
        if pid is None:  # not in the last stats poll yet: the next request will do
            return
        os.kill(pid, signal.SIGKILL)
        killed.update(replica=replica, pid=pid, at=time.monotonic(), after=len(done))

    retries0 = _health(url)["engine"].get("retries", 0)
    replays0 = _health(url)["engine"].get("replays", 0)
    results, wall = asyncio.run(run_load(url, bodies, args.concurrency, on_first, done))
    out = {"sent": len(bodies), "answered": sum(1 for r in results if r.error is None),
           "lost": sum(1 for r in results if r.error is not None),
           "wrong": sum(1 for r in results if r.error is None and reference.get(r.index) not in (None, r.text)),
           "killed_after_answers": killed.get("after"), "wall_s": round(wall, 2),
           "error_examples": [r.error for r in results if r.error][:3]}
    if killed:
        try:
            _wait_replicas(url, args.replicas, args.restart_timeout, exclude={killed["replica"]})
            out["restarted_s"] = round(time.monotonic() - killed["at"], 1)  # from the kill
        except TimeoutError:
            out["restarted_s"] = None
        h = _health(url)["engine"]
        out["retries"] = h.get("retries", 0) - retries0
        out["replays"] = h.get("replays", 0) - replays0
    return out


def run_cluster(args: argparse.Namespace) -> dict:
    """Everything but the re-exec (see the module docstring); returns the report."""
    import ray
    from ray import serve

    from stencil.engine.config import EngineConfig
    from stencil.service.cluster.deploy import ClusterOptions, build_app, start_local_ray, start_serve
    from stencil.service.state import ServiceConfig

    tmp = Path(tempfile.mkdtemp(prefix="stb-", dir="/tmp"))  # short: Ray's socket paths have a limit
    try:
        if args.model == "tiny":
            from stencil.benchmarks.soak import _tiny_model

            model = _tiny_model(tmp / "tiny")
        elif args.model is None:
            from stencil.engine.models.default_model import ensure_default_model

            model = ensure_default_model()
        else:
            model = Path(args.model)
        workload = shared_prefix_workload(args.prompts, args.users, args.prompt_sentences, args.seed)
        from stencil.engine.models.tokenizer import load_tokenizer

        tok = load_tokenizer(model)
        system_tokens = [len(tok.encode(tok.apply_chat_template(w["messages"][:1], tokenize=False),
                                        add_special_tokens=False)) for w in workload]
        blocks_per_prompt = max(system_tokens) // 16 + 1
        kv_blocks = args.num_kv_blocks or int(blocks_per_prompt * max(1, args.prompts // 2) * 1.15
                                              + 4 * args.concurrency)
        bodies = [{"messages": w["messages"], "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
                  for w in workload]
        cfg = EngineConfig(model=model, num_kv_blocks=kv_blocks, num_threads=args.threads,
                           max_num_seqs=max(8, args.concurrency)).validate()
        scfg = ServiceConfig(max_tokens_cap=max(256, args.max_tokens), request_timeout_s=600)
        report: dict = {"replicas": args.replicas, "model": str(model), "provisional": True,
                        "workload": {"system_prompts": args.prompts, "users_per_prompt": args.users,
                                     "requests": len(bodies), "system_prompt_tokens": max(system_tokens),
                                     "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                                     "kv_blocks_per_replica": kv_blocks, "threads_per_replica": args.threads}}
        t0 = time.monotonic()
        start_local_ray(num_cpus=max(args.replicas, os.cpu_count() or 1), temp_dir=str(tmp / "ray"))
        port = _free_port()
        report["serve_start_attempts"] = start_serve("127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        report["ray_start_s"] = round(time.monotonic() - t0, 1)
        outputs: dict[str, list[str]] = {}
        routers = [r for r in args.routers.split(",") if r]
        for k, router in enumerate(routers):
            t = time.monotonic()
            opts = ClusterOptions(replicas=args.replicas, router=router, replica_cpus=1.0, graceful_shutdown_s=5.0)
            serve.run(build_app(cfg, scfg, opts), name="stencil", route_prefix="/")
            _wait_replicas(url, args.replicas, 120)
            deploy_s = time.monotonic() - t
            if k == 0:
                report["api"] = _api_checks(url, model.name)
            time.sleep(1.5)  # one stats period: counters as of now, the checks above included
            before = _replica_counters(url)
            results, wall = asyncio.run(run_load(url, bodies, args.concurrency))
            time.sleep(1.5)  # one stats period: the replicas' counters include the last requests
            summary = _summary(results, wall, before, _replica_counters(url))
            summary["deploy_s"] = round(deploy_s, 1)
            report[router] = summary
            outputs[router] = [r.text if r.error is None else f"<error {r.error}>" for r in results]
            print(f"{router:12s} hit rate {summary['prefix_hit_rate']:.2f}  ttft p50 {summary['ttft_ms_p50']:.0f} ms"
                  f"  p99 {summary['ttft_ms_p99']:.0f} ms  {summary['output_tokens_per_s']:.1f} tok/s"
                  f"  errors {summary['errors']}  split {summary['requests_per_replica']}", flush=True)
            if k < len(routers) - 1:
                serve.delete("stencil")
        first = next(iter(outputs.values()))
        report["outputs_identical"] = all(o == first for o in outputs.values())
        if args.kill_requests > 0:
            kill_bodies = [bodies[i % len(bodies)] for i in range(args.kill_requests)]
            reference = {i: first[i % len(first)] for i in range(len(kill_bodies))}
            report["replica_kill"] = _kill_phase(url, kill_bodies, reference, args)
            print(f"replica kill: {report['replica_kill']}", flush=True)
        serve.shutdown()
        return report
    finally:
        try:
            ray.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _reexec_in_namespace(argv: list[str]) -> int:
    """Run this benchmark again under ``unshare -n`` with loopback up; its exit status."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("stencil bench cluster: needs `unshare` and `ip` to run Ray in a private network namespace",
              file=sys.stderr)
        return 2
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
           sys.executable, "-m", "stencil.benchmarks.cluster", *argv]
    env = {**os.environ, NETNS_ENV: "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.call(cmd, env=env, cwd=Path(__file__).resolve().parents[1])


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if os.environ.get(NETNS_ENV) != "1":
        return _reexec_in_namespace(argv if argv is not None else sys.argv[sys.argv.index("cluster") + 1:])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from stencil.service.cluster.deploy import require_ray

    try:
        require_ray()
    except RuntimeError as e:
        print(f"stencil bench cluster: {e}", file=sys.stderr)
        return 2
    report = run_cluster(args)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m stencil.benchmarks.cluster")
    add_arguments(parser)
    sys.exit(main(parser.parse_args(), sys.argv[1:]))
