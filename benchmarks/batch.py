"""``stencil bench batch``: ``stencil batch --url`` against ``stencil bench serve``'s client, same requests, one run.

``stencil bench batch [--lines 1000] [--concurrency 8] [--mode throughput|resume|both] [--model FILE |
--base-url URL] --json PATH``

The requests are ``stencil bench serve --workload person``'s (``serve.workload_jobs``: one-sentence
name/age/city chats, JSON Schema as ``response_format``, greedy), ``--lines`` of them, to one server: the
default model's ``stencil serve`` started here on a free loopback port, or ``--base-url``.

``throughput``: for each of ``--rounds`` rounds, the jobs are sent once by ``stencil batch``'s machinery
(``service/batch.py``: ``prepare`` and ``dispatch`` with ``--url``, the progress bar, each line fsync'd) as
``/v1/chat/completions`` batch lines, and once by ``stencil bench serve``'s closed loop (``serve.run_level``),
at the same ``--concurrency``; the two alternate which goes first. Each run's prompts start with their own tag
(``[run b1]``, ``[run s1]``: the same number of tokens) so neither is served from the other's prefix cache.
Reported: requests/s of each (all lines over the wall time, from reading INPUT to the last line on disk for
batch), their ratio batch/serve, and the valid fraction (jsonschema on each answer). The two differ in one
thing a batch line cannot change: ``bench serve`` streams (SSE, with logprobs), ``stencil batch`` does not.

``resume``: the lines are answered by one uninterrupted ``stencil batch --url`` process, then again into a
new OUTPUT by a process killed (SIGKILL) at ``--kills`` points and restarted each time; the points are counts
of finished lines in OUTPUT (seeded by ``--seed``), not times. Reported: whether every custom_id is answered
exactly once, and how many answers (status and content) equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stencil.benchmarks import serve
from stencil.benchmarks.common import is_valid, make_validator
from stencil.service import batch

ROUTE = "/v1/chat/completions"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=1000, help="requests (batch lines) per run")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight, both clients")
    p.add_argument("--mode", choices=("throughput", "resume", "both"), default="throughput",
                   help="throughput: batch against bench serve's client; resume: batch killed and resumed "
                        "against one uninterrupted run")
    p.add_argument("--rounds", type=int, default=20,
                   help="throughput: the lines are cut into this many rounds, each sent by both clients in turn "
                        "(alternating which goes first)")
    p.add_argument("--kills", type=int, default=3, help="resume mode: kills, at random finished-line counts")
    p.add_argument("--seed", type=int, default=0, help="resume mode: picks the kill points")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF file for the server started here (default: the default model)")
    p.add_argument("--base-url", default=None, help="a running server (loopback) instead of starting one")
    p.add_argument("--api-key", default="none", help="sent as a bearer token")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    p.add_argument("--json", type=Path, default=Path("out/bench_batch.json"), help="where to write the report")
    # The server started here: its own defaults unless told (``soak.OwnServer``'s flags).
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=None)


def batch_lines(jobs: list[serve.Job], model: str, max_tokens: int) -> list[str]:
    """The jobs as OpenAI batch lines (custom_id ``p<i>``): ``bench serve``'s request bodies, not streamed."""
    return [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": ROUTE,
                        "body": serve.request_body(job, model, max_tokens, stream=False)})
            for i, job in enumerate(jobs)]


def answers(path: Path) -> dict[str, list[tuple[int | None, str | None]]]:
    """OUTPUT's answers by custom_id: (status or None, the chat's content or None), one per line."""
    out: dict[str, list] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(raw)
        response = rec["response"]
        status = content = None
        if response is not None:
            status = response["status_code"]
            body = response["body"] if isinstance(response["body"], dict) else {}
            choices = body.get("choices") or [{}]
            content = (choices[0].get("message") or {}).get("content")
        out.setdefault(rec["custom_id"], []).append((status, content))
    return out


def valid_fraction(found: dict[str, list], schema: dict, lines: int) -> float:
    """The share of ``lines`` custom_ids answered 200 once with content valid against ``schema``."""
    validator = make_validator(schema)
    ok = sum(len(v) == 1 and v[0][0] == 200 and v[0][1] is not None and is_valid(v[0][1], validator)
             for v in found.values())
    return ok / lines


def run_batch_here(lines: list[str], folder: Path, url: str, concurrency: int, api_key: str,
                   timeout: float) -> tuple[float, Path]:
    """``stencil batch INPUT OUTPUT --url url`` through ``service/batch.py`` in this process; (wall s, OUTPUT).
    The wall time runs from reading INPUT to the last answer on disk."""
    inp, out = folder / "input.jsonl", folder / "output.jsonl"
    inp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.unlink(missing_ok=True)
    args = argparse.Namespace(url=url, concurrency=concurrency, request_timeout=timeout, api_key=api_key,
                              output=out)
    t0 = time.perf_counter()
    todo, skipped = batch.prepare(inp, out)
    tally = batch.dispatch(args, todo, skipped, app_factory=None)
    wall = time.perf_counter() - t0
    if tally.unanswered:
        raise RuntimeError(f"stencil batch left {tally.unanswered} lines unanswered")
    return wall, out


def throughput(root: str, url: str, model: str, jobs: list[serve.Job], args, folder: Path) -> dict:
    """The jobs cut into ``args.rounds`` rounds, each round's sent by both clients, alternating which goes
    first (a shared machine's drift falls on both); the report's ``throughput``."""
    # The first requests at full concurrency are slower (the server's first batches of that size): not timed.
    warm = [serve.tagged(j, "[warm]") for j in serve.workload_jobs("person", 2 * args.concurrency)[0]]
    asyncio.run(serve.run_level(root, model, warm, args.concurrency, args.max_tokens, args.api_key, args.timeout))
    runs: list[dict] = []
    schema = jobs[0].schema
    size = -(-len(jobs) // args.rounds)
    for r in range(1, args.rounds + 1):
        order = ("batch", "serve") if r % 2 else ("serve", "batch")
        for client in order:
            level_jobs = [serve.tagged(j, f"[run {client[0]}{r}]") for j in jobs[(r - 1) * size:r * size]]
            if client == "serve":
                s = asyncio.run(serve.run_level(root, model, level_jobs, args.concurrency, args.max_tokens,
                                                args.api_key, args.timeout))
                run = {"client": "serve", "round": r, "wall_s": s["wall_s"], "requests_per_s": s["requests_per_s"],
                       "valid_fraction": s["valid_fraction"], "errors": s["errors"]}
            else:
                wall, out = run_batch_here(batch_lines(level_jobs, model, args.max_tokens), folder, url,
                                           args.concurrency, args.api_key, args.timeout)
                found = answers(out)
                errors = sum(st != 200 for v in found.values() for st, _ in v)
                run = {"client": "batch", "round": r, "wall_s": wall, "requests_per_s": len(level_jobs) / wall,
                       "valid_fraction": valid_fraction(found, schema, len(level_jobs)), "errors": errors}
            run["requests"] = len(level_jobs)
            runs.append(run)
            print(f"[batch] round {r} {client}: {run['requests_per_s']:.2f} req/s, valid "
                  f"{run['valid_fraction']:.3f}, errors {run['errors']}", flush=True)
    totals = {}
    for client in ("batch", "serve"):
        mine = [x for x in runs if x["client"] == client]
        wall = sum(x["wall_s"] for x in mine)
        totals[client] = {"requests_per_s": len(jobs) / wall,
                          "valid_fraction": sum(x["valid_fraction"] * x["requests"] for x in mine) / len(jobs),
                          "errors": sum(x["errors"] for x in mine)}
    ratio = totals["batch"]["requests_per_s"] / totals["serve"]["requests_per_s"]
    by_round = [b["requests_per_s"] / s["requests_per_s"] for b, s in zip(
        *([x for x in runs if x["client"] == c] for c in ("batch", "serve")))]
    return {"runs": runs, "batch": totals["batch"], "serve": totals["serve"], "ratio_requests_per_s": ratio,
            "ratio_requests_per_s_median_of_rounds": statistics.median(by_round)}


def batch_process(inp: Path, out: Path, url: str, concurrency: int, api_key: str) -> subprocess.Popen:
    """``stencil batch INPUT OUTPUT --url url`` as its own process (stdout and stderr dropped)."""
    cmd = [sys.executable, "-m", "stencil.service.cli", "batch", str(inp), str(out), "--url", url,
           "--concurrency", str(concurrency), "--api-key", api_key]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finished_lines(path: Path) -> int:
    """Complete lines in ``path`` (0 while it does not exist)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def killed_and_resumed(inp: Path, out: Path, points: list[int], url: str, concurrency: int,
                       api_key: str, timeout: float) -> list[int]:
    """Run ``stencil batch`` into ``out``, SIGKILL it once ``out`` holds each of ``points`` lines (in order),
    restart it each time, and let the last run finish; the lines ``out`` held after each kill.

    Raises:
        RuntimeError: a run exited with an error, or ended before its kill point.
    """
    held = []
    for point in [*points, None]:
        proc = batch_process(inp, out, url, concurrency, api_key)
        deadline = time.monotonic() + timeout
        while point is not None and finished_lines(out) < point and proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"stencil batch did not reach {point} lines in {timeout:.0f} s")
            time.sleep(0.005)
        if point is None or proc.poll() is not None:
            rc = proc.wait(timeout)
            if rc != 0 or point is not None:
                raise RuntimeError(f"stencil batch exited with {rc} before its kill point {point}")
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        held.append(finished_lines(out))
    return held


def resume(url: str, model: str, jobs: list[serve.Job], args, folder: Path) -> dict:
    """One uninterrupted ``stencil batch`` run against one killed ``--kills`` times; the report's ``resume``."""
    inp = folder / "resume_input.jsonl"
    inp.write_text("\n".join(batch_lines(jobs, model, args.max_tokens)) + "\n", encoding="utf-8")
    whole, pieces = folder / "whole.jsonl", folder / "pieces.jsonl"
    for path in (whole, pieces):
        path.unlink(missing_ok=True)
    killed_and_resumed(inp, whole, [], url, args.concurrency, args.api_key, args.timeout)
    rng = random.Random(args.seed)
    points = sorted(rng.sample(range(1, len(jobs)), min(args.kills, len(jobs) - 1)))
    held = killed_and_resumed(inp, pieces, points, url, args.concurrency, args.api_key, args.timeout)
    a, b = answers(whole), answers(pieces)
    ids = {f"p{i}" for i in range(len(jobs))}
    once = set(b) == ids and all(len(v) == 1 for v in b.values())
    same = sum(a.get(cid) == b.get(cid) for cid in ids)
    out = {"kill_points": points, "lines_after_each_kill": held, "every_line_answered_once": once,
           "same_as_uninterrupted": same, "lines": len(jobs),
           "valid_fraction": valid_fraction(b, jobs[0].schema, len(jobs)),
           "valid_fraction_uninterrupted": valid_fraction(a, jobs[0].schema, len(jobs))}
    if same < len(jobs):
        out["first_differences"] = [{"custom_id": cid, "uninterrupted": a.get(cid), "resumed": b.get(cid)}
                                    for cid in sorted(ids, key=lambda c: int(c[1:])) if a.get(cid) != b.get(cid)][:5]
    print(f"[batch] resume: killed at {held} lines, answered once {once}, same as one run {same}/{len(jobs)}",
          flush=True)
    return out


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.soak import OwnServer

    server = None
    if args.base_url is None:
        from stencil.engine.models.default_model import ensure_default_model

        model_path = args.model or ensure_default_model(lambda line: print(line, flush=True))
        # A SIGTERM ends the run through ``finally``, so that the server started here stops too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        server = OwnServer(model_path, args)
        url = server.url
    else:
        url = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        root = serve.v1_root(url)
    except serve.NotLoopback as e:
        print(f"stencil bench batch: {e}")
        return 2
    try:
        if server is not None:
            server.wait_ready()
        model = serve.served_model(root, args.api_key)
        jobs, workload = serve.workload_jobs("person", args.lines)
        asyncio.run(serve.warm(root, model, jobs, args.api_key, args.timeout, args.max_tokens))
        report: dict = {"lines": args.lines, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                        "model": model, "workload": workload, "route": ROUTE}
        with tempfile.TemporaryDirectory(prefix="bench_batch_") as tmp:
            if args.mode in ("throughput", "both"):
                report["throughput"] = throughput(root, url, model, jobs, args, Path(tmp))
                t = report["throughput"]
                print(f"[batch] batch {t['batch']['requests_per_s']:.2f} req/s, serve "
                      f"{t['serve']['requests_per_s']:.2f} req/s, ratio {t['ratio_requests_per_s']:.3f} "
                      f"(median of the rounds' {t['ratio_requests_per_s_median_of_rounds']:.3f})", flush=True)
            if args.mode in ("resume", "both"):
                report["resume"] = resume(url, model, jobs, args, Path(tmp))
    finally:
        if server is not None:
            server.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    bad = report.get("resume", {}).get("every_line_answered_once") is False
    errors = sum(report.get("throughput", {}).get(c, {}).get("errors", 0) for c in ("batch", "serve"))
    return 1 if bad or errors else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
