"""Soak: long mixed load against a server on loopback; afterwards nothing may be left behind.

``stencil bench soak --duration S --concurrency C [--url URL] [--model DIR|tiny] --json PATH``

Unless ``--url`` is given, the benchmark starts its own server (``stencil serve`` in a child
process on 127.0.0.1, a free port) with the default model, a model directory, or ``tiny`` (a
2-layer random Llama with SmolLM2's tokenizer, built in a temporary directory). ``C`` workers
then send requests until ``S`` seconds have passed, each drawn at random: ``/generate`` or
``/v1/chat/completions``; unconstrained, JSON schema, regex or choice; streamed or not; and a
client that behaves, hangs up mid-stream, or gives up after a short timeout. Every request is
counted once by outcome: answered, aborted (by the client, on purpose), 429, other 4xx, 5xx
(a stream's in-band error with a 5xx status counts as 5xx), or a transport error.

Afterwards (``/health`` and ``/metrics``, after at most 30 s for aborts to land) the
invariants are: every KV block is free, no request is running or waiting and none is in
flight, the outcome counts add up to the requests sent, no 5xx and no transport error, at
least one request answered, and, for its own server, the server's resident memory grew by at
most ``--max-rss-growth-mb`` over the second half of the load (half-time to ``--duration``: the
ramp to thousands of open connections and the first fill of caches come before), and SIGTERM
stops it with status 0. With ``--rounds N`` the load runs N times in a row on the same server,
and the last round's end RSS may be at most ``--max-round-rss-ratio`` times the first's (memory
that only grows shows here); with ``--reference-concurrency R`` a first phase of R clients
(all running, none waiting: R = ``--max-num-seqs``) gives the peak RSS that the rounds' peak
may exceed by at most ``--max-peak-rss-ratio`` (what thousands of waiting clients cost). The
outcome counts of the report are the rounds' sums; its RSS keys are the last round's. The exit
status is 1 if any invariant fails. The report also has the
server's RSS every 5 s until the last client is done (``rss_timeline_mb``, the drain of queued
requests after the deadline included), at 10 % of the run, at half-time, at the deadline and
at rest: after the settle (the engine idle) and one heap-trim interval more
(``stencil.engine.malloc.DEFAULT_INTERVAL_S`` + 2 s), so the end RSS is measured after the idle engine
handed freed memory back, not at whichever moment of the trim cycle the settle ended.

Only loopback addresses are contacted; every loop is bounded by the deadline (clients finish
the request they have in flight, which the server's own request deadline bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stencil.benchmarks.common import pct
from stencil.engine.malloc import DEFAULT_INTERVAL_S

# After the settle, the end RSS waits this long: one heap-trim interval of the idle engine and 2 s.
REST_S = DEFAULT_INTERVAL_S + 2.0

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
COLORS = ["red", "green", "blue"]
PROMPTS = ["Tell me about Ada, 36, a mathematician.", "What is the date today?", "Pick a color.",
           "Write one sentence about the sea.", "List three fruits."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    p.add_argument("--url", default=None, help="server to load (loopback only); default: start one")
    p.add_argument("--model", default=None, help="model directory, or 'tiny' (default: the default model)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="waiting-queue limit of the started server (default: the server's)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="running-request limit of the started server (default: the server's)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks of the started server "
                   "(default: the server's)")
    p.add_argument("--disconnect-rate", type=float, default=0.08, help="share of clients that hang up")
    p.add_argument("--timeout-rate", type=float, default=0.07, help="share of clients that give up early")
    p.add_argument("--queue-timeout-rate", type=float, default=0.05,
                   help="share of /generate requests that may wait only 1-10 s for a running slot "
                        "(queue_timeout; past it: 429)")
    p.add_argument("--ramp", type=float, default=None,
                   help="seconds over which the clients start (default: min(10, duration / 10))")
    p.add_argument("--max-health-ms", type=float, default=250.0,
                   help="bound on the p99 of /health and /metrics during the load (ms; 0: not checked)")
    p.add_argument("--min-answered-share", type=float, default=0.5,
                   help="least share of the sent requests answered 200 (0: not checked)")
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0,
                   help="allowed server RSS growth from the end of warm-up to the end (MiB)")
    p.add_argument("--rounds", type=int, default=1,
                   help="identical load phases in a row on the same server, each reported with its RSS at warm "
                        "(10%% of it), peak and end (after the settle)")
    p.add_argument("--reference-concurrency", type=int, default=0,
                   help="first a reference phase with this many clients (e.g. 256 = --max-num-seqs: every client "
                        "running, none waiting); its peak RSS is the yardstick of --max-peak-rss-ratio (0: none)")
    p.add_argument("--reference-duration", type=float, default=None,
                   help="seconds of the reference phase (default: --duration / 4)")
    p.add_argument("--max-peak-rss-ratio", type=float, default=1.5,
                   help="bound on the rounds' peak RSS over the reference phase's (0: not checked)")
    p.add_argument("--max-round-rss-ratio", type=float, default=1.05,
                   help="bound on the last round's end RSS over the first round's (0: not checked)")
    p.add_argument("--rest-s", type=float, default=REST_S,
                   help="seconds after the settle before a phase's end RSS (default: the engine's "
                        "heap-trim interval + 2 s, so the idle engine has trimmed; 0: at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the report here")


# -- the server ------------------------------------------------------------------------------------

def _tiny_model(out: Path) -> Path:
    """A 2-layer random Llama (hidden 64) with the default model's tokenizer, as in the tests."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stencil.engine.models.default_model import ensure_default_model
    from stencil.engine.models.tokenizer import load_tokenizer

    config = AutoConfig.for_model(
        "llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # far from uniform logits, so outputs look like the tests' tiny model
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.15)
    model.save_pretrained(str(out))
    load_tokenizer(ensure_default_model()).save_pretrained(str(out))
    return out


def _rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MiB (Linux ``/proc``), None where unreadable."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class OwnServer:
    """``stencil serve`` in a child process on a free loopback port (``extra_args``: more flags)."""

    def __init__(self, model: Path, args: argparse.Namespace, extra_args: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "stencil.service.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--max-tokens-cap", str(max(args.max_tokens, 16)),
               "--log-level", "warning", "--shutdown-grace", "20"]
        # Unless told otherwise the server runs on its own defaults: they must make 200-or-429
        # the normal outcome under any number of clients.
        for flag, value in (("--num-kv-blocks", args.num_kv_blocks), ("--max-num-seqs", args.max_num_seqs),
                            ("--max-waiting", args.max_waiting)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += list(extra_args)  # other benchmarks' server flags (``bench fuzz``, ``bench slowclients``)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # The log goes to a file, not a pipe: nobody reads a pipe during the run, and a full one
        # would block the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[1],
                                     stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def log_tail(self, n: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server did not become healthy")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait; the exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


# -- the load --------------------------------------------------------------------------------------

@dataclass(slots=True)
class Tally:
    """Outcome counts and the latencies of answered requests (ms)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("sent", "answered", "aborted", "rejected_429", "errors_4xx", "errors_5xx", "transport_errors"), 0))
    latencies_ms: list[float] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # first few unexpected outcomes, for the report

    def note(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome in ("errors_4xx", "errors_5xx", "transport_errors") and len(self.examples) < 10:
            self.examples.append(f"{outcome}: {detail[:300]}")


def _request(rng: random.Random, max_tokens: int, queue_timeout_rate: float = 0.0) -> tuple[str, dict, str]:
    """(path, body, constraint kind) of one random request."""
    kind = rng.choice(["none", "none", "schema", "regex", "choice"])
    n = rng.randint(1, max_tokens)
    if kind != "none":
        # A constrained answer needs room for its shortest form (PERSON 8 tokens, DATE 10);
        # below it the server refuses with a 400 by design: keep these feasible.
        n = max(n, min(12, max_tokens))
    prompt = rng.choice(PROMPTS)
    stream = rng.random() < 0.5
    if rng.random() < 0.7:
        body = {"prompt": prompt, "max_tokens": n, "stream": stream, "temperature": rng.choice([0.0, 0.8])}
        if kind == "schema":
            body["response_schema"] = PERSON
        elif kind == "regex":
            body["regex"] = DATE
        elif kind == "choice":
            body["choice"] = COLORS
        if rng.random() < queue_timeout_rate:
            body["queue_timeout"] = round(rng.uniform(1.0, 10.0), 2)
        return "/generate", body, kind
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "stream": stream}
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    elif kind != "none":
        kind = "none"
    return "/v1/chat/completions", body, kind


_OPENAI_TYPE_STATUS = {"server_error": 500, "service_unavailable": 503, "timeout": 504,
                       "rate_limit_error": 429}


def _stream_failed(line: str) -> int | None:
    """The status of an in-band stream error event, else None."""
    if not line.startswith("data: ") or '"error"' not in line:
        return None
    event = json.loads(line[len("data: "):])
    if event.get("type") == "error":
        return int(event["error"]["status"])
    if isinstance(event.get("error"), dict):  # OpenAI's shape: the status is in the error type
        return _OPENAI_TYPE_STATUS.get(event["error"].get("type"), 400)
    return None


async def _one(ac: httpx.AsyncClient, rng: random.Random, args, tally: Tally) -> float:
    """Send one request and record its outcome; return a pause to take before the next (s)."""
    path, body, kind = _request(rng, args.max_tokens, args.queue_timeout_rate)
    behaviour = rng.random()
    hang_up = behaviour < args.disconnect_rate
    give_up = not hang_up and behaviour < args.disconnect_rate + args.timeout_rate
    key = f"{path} {kind} {'stream' if body['stream'] else 'plain'}"
    tally.kinds[key] = tally.kinds.get(key, 0) + 1
    tally.counts["sent"] += 1
    t0 = time.perf_counter()
    # A behaving client waits as long as the server may keep it queued (its request timeout,
    # 300 s) and more: the server answers first.
    timeout = httpx.Timeout(rng.uniform(0.02, 0.3) if give_up else 900.0, connect=30.0)
    try:
        async with ac.stream("POST", path, json=body, timeout=timeout) as r:
            if r.status_code == 429:
                tally.note("rejected_429")
                return min(float(r.headers.get("retry-after", "1")), 1.0) * rng.random()
            if r.status_code >= 400:
                text = (await r.aread()).decode(errors="replace")
                tally.note("errors_5xx" if r.status_code >= 500 else "errors_4xx", f"{r.status_code} {text}")
                return 0.0
            if not body["stream"]:
                await r.aread()
                tally.note("answered")
                tally.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                return 0.0
            events, done, failed = 0, False, None
            async for line in r.aiter_lines():
                failed = failed or _stream_failed(line)
                events += line.startswith("data: ")
                done = done or line == "data: [DONE]"
                if hang_up and events >= 2:
                    tally.note("aborted")  # leaving the block closes the connection mid-stream
                    return 0.0
            if failed is not None:
                tally.note("errors_5xx" if failed >= 500 else "errors_4xx", f"in-band {failed} for {body}")
            elif done:
                tally.note("answered")
                tally.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            else:
                tally.note("transport_errors", f"stream ended without [DONE] for {body}")
    except httpx.TimeoutException:
        tally.note("aborted" if give_up else "transport_errors", f"timeout for {body}")
    except httpx.TransportError as e:
        tally.note("transport_errors", f"{type(e).__name__}: {e}")
    return 0.0


async def _load(url: str, args, tally: Tally, on_tick) -> float:
    """Run the workers until the deadline (each finishes the request it has in flight); return
    the wall time (s). Worker ``i`` starts ``i / C`` of the way through the ramp."""
    import ssl

    start = time.monotonic()
    deadline = start + args.duration
    ramp = args.ramp if args.ramp is not None else min(10.0, args.duration / 10)
    # One connection per client, as a browser tab or a script would hold; one TLS context for
    # all (loopback is plain HTTP, but httpx builds a context per client, loading the CA store).
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    tls = ssl.create_default_context()

    async def worker(i: int) -> None:
        await asyncio.sleep(ramp * i / max(args.concurrency, 1))
        rng = random.Random(args.seed * 10_007 + i)
        async with httpx.AsyncClient(base_url=url, limits=limits, verify=tls) as ac:
            while time.monotonic() < deadline:
                pause = await _one(ac, rng, args, tally)
                if pause:
                    await asyncio.sleep(pause)

    finished = asyncio.Event()

    async def ticker() -> None:
        # On until the last client is done: the drain after the deadline is part of the run.
        while not finished.is_set():
            on_tick(time.monotonic() - start)
            try:
                await asyncio.wait_for(finished.wait(), 0.5)
            except TimeoutError:
                pass

    async def clients() -> None:
        try:
            await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        finally:
            finished.set()

    await asyncio.gather(ticker(), clients())
    return time.monotonic() - start


# -- afterwards ------------------------------------------------------------------------------------

def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def _settle(url: str, timeout_s: float = 30.0) -> tuple[dict, dict]:
    """Poll until the engine is idle (aborts land asynchronously) or ``timeout_s``; (health, metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        e = health["engine"]
        idle = (e["running"] == 0 and e["waiting"] == 0 and e["kv_blocks_free"] == e["kv_blocks_total"]
                and e.get("kv_sliding_blocks_free") == e.get("kv_sliding_blocks_total") and health["inflight"] == 0)
        if idle or time.monotonic() > deadline:
            return health, _metrics(url)
        time.sleep(0.2)


class Probe:
    """``stencil.benchmarks.probe`` in a process of its own: /health and /metrics latencies under load."""

    def __init__(self, url: str, interval_s: float = 0.2):
        self._out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        self._out.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "stencil.benchmarks.probe", url, str(interval_s), self._out.name],
                                     cwd=Path(__file__).resolve().parents[1])

    def stop(self) -> dict:
        """End the probing; its ``health_ms``, ``metrics_ms`` lists and ``failures`` count."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
            return json.loads(Path(self._out.name).read_text() or "{}")
        except (subprocess.TimeoutExpired, ValueError, OSError):
            self.proc.kill()
            return {}
        finally:
            Path(self._out.name).unlink(missing_ok=True)


def _raise_fd_limit(concurrency: int) -> None:
    """Every client holds a socket here and one in the server: raise the soft open-files limit
    (inherited by the server started here) to what the run needs, within the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * concurrency + 1024
    cap = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, cap), hard))
    if min(need, cap) < need:
        print(f"stencil bench soak: only {cap} open files allowed; {need} wanted", file=sys.stderr)


def _run_load(url: str, args, tally: Tally, on_tick) -> float:
    """``_load`` on uvloop when it is installed (less client CPU beside the server)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_load(url, args, tally, on_tick))
    return uvloop.run(_load(url, args, tally, on_tick))


@dataclass(slots=True)
class Phase:
    """One load phase against the server: its outcomes, the server's RSS, probes and state after."""

    name: str
    concurrency: int
    tally: Tally
    wall_s: float
    rss: dict
    timeline: list
    probes: dict
    health: dict
    metrics: dict

    def summary(self) -> dict:
        c = self.tally.counts
        return {"name": self.name, "concurrency": self.concurrency, **c, "duration_s": round(self.wall_s, 1),
                "rss_warm_mb": self.rss["warm"], "peak_rss_mb": self.rss["peak"],
                "rss_load_end_mb": self.rss["load_end"], "rss_end_mb": self.rss["end"],
                "running_max": self.probes.get("running_max"), "waiting_max": self.probes.get("waiting_max"),
                "health_ms_p99": pct(self.probes.get("health_ms", []), 99),
                "latency_ms_p50": pct(self.tally.latencies_ms, 50)}


def _phase(name: str, url: str, pid: int | None, args, concurrency: int, duration: float) -> Phase:
    """Run the load with ``concurrency`` clients for ``duration`` s, then let it settle."""
    import copy

    run_args = copy.copy(args)
    run_args.concurrency, run_args.duration = concurrency, duration
    rss = {"peak": _rss_mb(pid) if pid else None, "warm": None, "half": None, "load_end": None, "end": None}
    timeline: list[tuple[float, float]] = []

    def on_tick(elapsed: float) -> None:
        if pid is None:
            return
        now = _rss_mb(pid)
        if now is not None:
            rss["peak"] = max(rss["peak"] or 0.0, now)
            if elapsed <= duration:
                rss["load_end"] = now
            if rss["warm"] is None and elapsed >= 0.1 * duration:
                rss["warm"] = now
            if rss["half"] is None and elapsed >= 0.5 * duration:
                rss["half"] = now
            if not timeline or elapsed - timeline[-1][0] >= 5.0:
                timeline.append((round(elapsed, 1), round(now, 1)))

    tally = Tally()
    probe = Probe(url)
    try:
        wall = _run_load(url, run_args, tally, on_tick)
    finally:
        probes = probe.stop()
    health, metrics = _settle(url)
    if pid and args.rest_s > 0:
        time.sleep(args.rest_s)  # at rest: the idle engine's next heap trim has run (engine/malloc.py)
    rss["end"] = _rss_mb(pid) if pid else None
    if rss["end"] is not None:
        rss["peak"] = max(rss["peak"] or 0.0, rss["end"])
    return Phase(name, concurrency, tally, wall, rss, timeline, probes, health, metrics)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _raise_fd_limit(max(args.concurrency, args.reference_concurrency))
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
        print("stencil bench soak: --url must be a loopback address", file=sys.stderr)
        return 2
    server, tmp = None, None
    if args.url is None:
        if args.model == "tiny":
            tmp = tempfile.TemporaryDirectory(prefix="stencil-soak-")
            model = _tiny_model(Path(tmp.name))
        elif args.model is None:
            from stencil.engine.models.default_model import ensure_default_model

            model = ensure_default_model()
        else:
            model = Path(args.model)
        server = OwnServer(model, args)
    reference: Phase | None = None
    rounds: list[Phase] = []
    try:
        if server is not None:
            server.wait_ready()
        url = server.url if server is not None else args.url.rstrip("/")
        pid = server.proc.pid if server is not None else None
        if args.reference_concurrency:
            reference = _phase("reference", url, pid, args, args.reference_concurrency,
                               args.reference_duration if args.reference_duration is not None else args.duration / 4)
        for k in range(args.rounds):
            rounds.append(_phase(f"round {k + 1}", url, pid, args, args.concurrency, args.duration))
    finally:
        exit_code = server.stop() if server is not None else None
        if tmp is not None:
            tmp.cleanup()

    last = rounds[-1]
    health, metrics, rss = last.health, last.metrics, last.rss
    e = health["engine"]
    c = {k: sum(p.tally.counts[k] for p in rounds) for k in last.tally.counts}
    latencies = [x for p in rounds for x in p.tally.latencies_ms]
    wall = sum(p.wall_s for p in rounds)
    left = e["running"] + e["waiting"]
    growth = (rss["load_end"] - rss["half"]
              if rss["load_end"] is not None and rss["half"] is not None else None)
    health_ms = [x for p in rounds for x in p.probes.get("health_ms", [])]
    metrics_ms = [x for p in rounds for x in p.probes.get("metrics_ms", [])]
    probe_failures = sum(p.probes.get("failures") or 0 for p in rounds) if all(p.probes for p in rounds) else None
    health_p99 = pct(health_ms, 99)
    answered_share = c["answered"] / c["sent"] if c["sent"] else 0.0
    peak = max((p.rss["peak"] for p in rounds if p.rss["peak"] is not None), default=None)
    peak_ratio = _ratio(peak, reference.rss["peak"]) if reference is not None else None
    round_ratio = _ratio(rounds[-1].rss["end"], rounds[0].rss["end"]) if len(rounds) > 1 else None
    every = ([reference] if reference is not None else []) + rounds
    invariants = {
        "all_kv_blocks_free": all(p.health["engine"]["kv_blocks_free"] == p.health["engine"]["kv_blocks_total"]
                                  and p.metrics.get("stencil_kv_blocks_used", 0.0) == 0.0
                                  and p.metrics.get("stencil_kv_sliding_blocks_used", 0.0) == 0.0 for p in every),
        "no_request_left": all(p.health["engine"]["running"] + p.health["engine"]["waiting"] == 0
                               and p.health["inflight"] == 0
                               and p.metrics.get("stencil_requests_running", 0.0) == 0.0
                               and p.metrics.get("stencil_requests_waiting", 0.0) == 0.0 for p in every),
        "counts_add_up": all(p.tally.counts["sent"] == sum(v for k, v in p.tally.counts.items() if k != "sent")
                             for p in every),
        "no_5xx": all(p.tally.counts["errors_5xx"] == 0 for p in every),
        "no_transport_errors": all(p.tally.counts["transport_errors"] == 0 for p in every),
        "some_answered": c["answered"] > 0,
        "engine_alive": health["status"] == "ok",
        "rss_growth_within_bound": growth is None or growth <= args.max_rss_growth_mb,
        "clean_shutdown": server is None or exit_code == 0,
        "health_p99_within_bound": not args.max_health_ms or (
            health_p99 is not None and max(health_p99, pct(metrics_ms, 99) or 0.0) <= args.max_health_ms
            and not probe_failures),
        "enough_answered": answered_share >= args.min_answered_share,
        "peak_rss_ratio_within_bound": peak_ratio is None or not args.max_peak_rss_ratio
                                       or peak_ratio <= args.max_peak_rss_ratio,
        "round_rss_ratio_within_bound": round_ratio is None or not args.max_round_rss_ratio
                                        or round_ratio <= args.max_round_rss_ratio,
    }
    report = {
        **c, "latency_ms_p50": pct(latencies, 50), "latency_ms_p99": pct(latencies, 99),
        "kv_blocks_total": e["kv_blocks_total"], "kv_blocks_free_after": e["kv_blocks_free"],
        "requests_left_after": left, "answered_share": round(answered_share, 4),
        "health_ms_p50": pct(health_ms, 50), "health_ms_p99": health_p99, "health_ms_max": max(health_ms, default=None),
        "metrics_ms_p50": pct(metrics_ms, 50), "metrics_ms_p99": pct(metrics_ms, 99),
        "probes": len(health_ms) + len(metrics_ms), "probe_failures": probe_failures,
        "queue_timeouts": metrics.get("stencil_queue_timeouts_total"),
        "peak_rss_mb": peak, "rss_warm_mb": rss["warm"], "rss_half_mb": rss["half"],
        "rss_load_end_mb": rss["load_end"], "rss_end_mb": rss["end"],
        "rss_growth_mb": growth, "rss_growth_bound_mb": args.max_rss_growth_mb,
        "rss_timeline_mb": last.timeline if last.rss["end"] is not None else None,
        "reference": reference.summary() if reference is not None else None,
        "rounds": [p.summary() for p in rounds],
        "peak_rss_ratio": peak_ratio, "peak_rss_ratio_bound": args.max_peak_rss_ratio,
        "round_rss_ratio": round_ratio, "round_rss_ratio_bound": args.max_round_rss_ratio,
        "duration_s": round(wall, 1), "concurrency": args.concurrency,
        "model": "url" if args.url else (args.model or "default"), "server_exit_code": exit_code,
        "requests_per_s": round(c["sent"] / wall, 2) if wall else None, "num_preemptions": e["num_preemptions"],
        "by_kind": {k: sum(p.tally.kinds.get(k, 0) for p in rounds) for r in rounds for k in r.tally.kinds},
        "unexpected": [x for p in every for x in p.tally.examples][:10], "invariants": invariants,
    }
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    failed = [k for k, ok in invariants.items() if not ok]
    if failed:
        print(f"stencil bench soak: invariants failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
