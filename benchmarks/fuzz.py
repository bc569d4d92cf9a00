"""API fuzzing at depth: the checks of ``tests/e2e/test_fuzz_api.py`` at any size, on fresh random cases.

``stencil bench fuzz [--examples N] [--seed S] [--modes positive,negative,servable,stateful]
[--operations PATH,...] [--under-soak] [--model tiny|DIR | --url URL] [--json PATH]``

Every documented operation is fuzzed in each mode of ``stencil.benchmarks.api_fuzz`` (its docstring has
the checks): ``N`` examples per operation and mode (an operation without inputs, such as
``GET /health``, has one distinct case), ``stateful`` runs ``N`` scenarios that follow the
document's links. Cases are random; the seed is reported, and ``--seed S`` with the same
arguments replays them (each failure kept also has a curl command). A failing case does not stop
the run: every failure is counted.

``--under-soak`` runs the same fuzzing while ``stencil.benchmarks.soak``'s load generator keeps
``--soak-concurrency`` clients busy on the same server (in ``--soak-round-s`` rounds, 10 s, until
the fuzzing ends):
mixed requests, streamed or not, clients that hang up or give up.

Unless ``--url`` is given, the benchmark starts ``stencil serve`` on 127.0.0.1 with the tiny
model (default) or a model directory, configured as the test's server: 256 KV blocks, 16 running
requests, a 16-token cap, a 2 s grammar-compile timeout, 256 KiB bodies, a 60 s request
deadline. Afterwards the invariants are: no failed check (0 x 5xx, 0 answers outside the
documented schema, every error and stream well formed), the soak's own counts without a 5xx or a
transport error, and nothing left in the engine (no request running, waiting or in flight, every
KV block free). Exit status 1 if one fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from stencil.benchmarks import soak

SERVER_ARGS = ("--num-kv-blocks", "256", "--max-num-seqs", "16", "--grammar-timeout", "2",
               "--max-body-bytes", str(256 << 10), "--request-timeout", "60")
MAX_TOKENS = 16  # the server's cap, and the soak's largest request
SOAK_ROUND_S = 10.0
# schemathesis's failures that mean an answer the document does not declare.
OUTSIDE_DOCUMENT = {"UndefinedStatusCode", "UndefinedContentType", "MalformedMediaType", "JsonSchemaError",
                    "MissingHeaders", "MissingContentType", "MalformedJson", "ContentDeserializationError",
                    "DiscriminatorMismatch"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", type=int, default=100, help="random examples per operation and mode "
                   "(stateful: scenarios)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: a fresh one, reported)")
    p.add_argument("--modes", default="positive,negative,servable,stateful",
                   help="comma-separated modes: positive, negative, servable, stateful")
    p.add_argument("--operations", default=None,
                   help="comma-separated paths to fuzz (default: every documented one)")
    p.add_argument("--steps", type=int, default=6, help="most calls in one stateful scenario")
    p.add_argument("--under-soak", action="store_true", help="fuzz while a soak load runs on the same server")
    p.add_argument("--soak-concurrency", type=int, default=8, help="soak clients with --under-soak")
    p.add_argument("--soak-round-s", type=float, default=SOAK_ROUND_S,
                   help="length of one soak round (s); rounds follow each other until the fuzzing ends")
    p.add_argument("--url", default=None, help="server to fuzz (loopback only); default: start one")
    p.add_argument("--model", default="tiny", help="model directory, or 'tiny' (default)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")


class SoakThread:
    """``stencil.benchmarks.soak``'s load generator in rounds on a thread, until ``stop``."""

    def __init__(self, url: str, concurrency: int, round_s: float = SOAK_ROUND_S):
        parser = argparse.ArgumentParser()
        soak.add_arguments(parser)
        self.args = parser.parse_args(["--duration", str(round_s), "--concurrency", str(concurrency),
                                       "--max-tokens", str(MAX_TOKENS), "--ramp", "1"])
        self.url = url
        self.tally = soak.Tally()
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.args.seed = self.rounds  # each round its own requests
            soak._run_load(self.url, self.args, self.tally, lambda elapsed: None)
            self.rounds += 1

    def start(self) -> "SoakThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Let the round in progress finish (its clients finish their requests), then return."""
        self._stop.set()
        self._thread.join()


@contextmanager
def _one_ast_parse_at_a_time():
    """Every ``ast.parse`` of this process under one lock while the fuzzing runs. CPython 3.11's
    AST object construction is not thread-safe (gh-106905, "SystemError: AST constructor recursion
    depth mismatch"): Hypothesis parses a lambda's source to describe a strategy on the fuzzing
    thread, and another thread of the same process may parse too (a module imported there that
    pytest rewrites, ``ast.literal_eval``); under ``make test`` on a loaded machine it failed a run."""
    lock = threading.RLock()
    original = ast.parse

    def parse(*args, **kwargs):
        with lock:
            return original(*args, **kwargs)

    ast.parse = parse
    try:
        yield
    finally:
        ast.parse = original


def fuzz_all(url: str, args, seed: int, log=print) -> list:
    """Run every selected (operation, mode); return the tallies (``stencil.benchmarks.api_fuzz.Tally``)."""
    from stencil.benchmarks import api_fuzz

    api = api_fuzz.load_api(url)
    wanted = set(args.operations.split(",")) if args.operations else None
    tallies = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in api_fuzz.MODES:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(api_fuzz.MODES)})")
        t0 = time.perf_counter()
        if mode == "stateful":
            tallies.append(api_fuzz.run_stateful(api, url, examples=args.examples, seed=seed, collect=True,
                                                 steps=args.steps))
        else:
            for path, method in api_fuzz.operations(api, mode):
                if wanted is None or path in wanted:
                    tallies.append(api_fuzz.run_mode(api, url, path, method, mode, examples=args.examples,
                                                     seed=seed, collect=True))
        done = [t for t in tallies if t.mode == mode]
        log(f"stencil bench fuzz: {mode}: {sum(t.examples for t in done)} cases, "
            f"{sum(t.failures for t in done)} failures, {time.perf_counter() - t0:.0f} s")
    return tallies


def _replay_command(args, seed: int) -> str:
    parts = ["stencil bench fuzz", f"--seed {seed}", f"--examples {args.examples}", f"--modes {args.modes}"]
    if args.operations:
        parts.append(f"--operations {args.operations}")
    if args.steps != 6:
        parts.append(f"--steps {args.steps}")
    if args.under_soak:
        parts.append(f"--under-soak --soak-concurrency {args.soak_concurrency}")
        if args.soak_round_s != SOAK_ROUND_S:
            parts.append(f"--soak-round-s {args.soak_round_s:g}")
    parts.append(f"--url {args.url}" if args.url else f"--model {args.model}")
    return " ".join(parts)


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
        print("stencil bench fuzz: --url must be a loopback address", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"stencil bench fuzz: seed {seed} (replay: {_replay_command(args, seed)})", file=sys.stderr)
    server, tmp = None, None
    if args.url is None:
        if args.model == "tiny":
            tmp = tempfile.TemporaryDirectory(prefix="stencil-fuzz-")
            model = soak._tiny_model(Path(tmp.name))
        else:
            model = Path(args.model)
        ns = argparse.Namespace(max_tokens=MAX_TOKENS, num_kv_blocks=None, max_num_seqs=None, max_waiting=None)
        server = soak.OwnServer(model, ns, SERVER_ARGS)
    load = None
    t0 = time.perf_counter()
    try:
        if server is not None:
            server.wait_ready()
        url = server.url if server is not None else args.url.rstrip("/")
        load = SoakThread(url, args.soak_concurrency, args.soak_round_s).start() if args.under_soak else None
        try:
            with _one_ast_parse_at_a_time():
                tallies = fuzz_all(url, args, seed, log=lambda m: print(m, file=sys.stderr))
        finally:
            if load is not None:
                load.stop()
        wall = time.perf_counter() - t0
        try:
            health, _ = soak._settle(url)
        except httpx.TransportError as exc:  # the server died: report it (with its log) as a failed run
            health = {"status": f"unreachable: {exc!r}", "inflight": -1,
                      "engine": {"running": -1, "waiting": -1, "kv_blocks_free": -1, "kv_blocks_total": 0}}
    finally:
        exit_code = server.stop() if server is not None else None
        log_tail = server.log_tail(4000) if server is not None else ""
        if tmp is not None:
            tmp.cleanup()

    e = health["engine"]
    cases = sum(t.examples for t in tallies)
    failures = sum(t.failures for t in tallies)
    fivexx = sum(n for t in tallies for k, n in t.statuses.items() if int(str(k).rsplit(" ", 1)[-1]) >= 500)
    kinds: dict[str, int] = {}
    for t in tallies:
        for k, n in t.kinds.items():
            kinds[k] = kinds.get(k, 0) + n
    outside = sum(n for k, n in kinds.items() if k in OUTSIDE_DOCUMENT)
    soak_counts = load.tally.counts if load is not None else None
    invariants = {
        "no_failed_check": failures == 0,
        "no_answer_outside_document": outside == 0,
        "no_5xx": fivexx == 0 and (soak_counts is None or soak_counts["errors_5xx"] == 0),
        "soak_no_transport_errors": soak_counts is None or soak_counts["transport_errors"] == 0,
        "soak_ran": soak_counts is None or soak_counts["answered"] > 0,
        "nothing_left_in_engine": e["running"] == 0 and e["waiting"] == 0 and health["inflight"] == 0,
        "all_kv_blocks_free": (e["kv_blocks_free"] == e["kv_blocks_total"]
                               and e.get("kv_sliding_blocks_free") == e.get("kv_sliding_blocks_total")),
        "engine_alive": health["status"] == "ok",
        "clean_shutdown": server is None or exit_code == 0,
    }
    report = {
        "seed": seed, "replay": _replay_command(args, seed), "examples_per_operation_and_mode": args.examples,
        "modes": args.modes, "cases": cases, "failures": failures, "failure_kinds": kinds, "responses_5xx": fivexx,
        "responses_outside_document": outside,
        "by_operation_and_mode": [t.as_dict() for t in tallies],
        "under_soak": args.under_soak, "soak": ({**soak_counts, "rounds": load.rounds,
                                                 "concurrency": args.soak_concurrency,
                                                 "unexpected": load.tally.examples}
                                                if load is not None else None),
        "kv_blocks_total": e["kv_blocks_total"], "kv_blocks_free_after": e["kv_blocks_free"],
        "requests_left_after": e["running"] + e["waiting"], "inflight_after": health["inflight"],
        "duration_s": round(wall, 1), "model": "url" if args.url else args.model,
        "server_exit_code": exit_code, "invariants": invariants,
    }
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    failed = [k for k, ok in invariants.items() if not ok]
    if failed:
        if (fivexx or not invariants["engine_alive"] or not invariants["clean_shutdown"]) and log_tail:
            print(f"server log (tail):\n{log_tail}", file=sys.stderr)
        print(f"stencil bench fuzz: invariants failed: {', '.join(failed)} (replay: {report['replay']})",
              file=sys.stderr)
        return 1
    return 0
