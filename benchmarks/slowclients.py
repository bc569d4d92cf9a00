"""Slow clients: does a stalled reader, or a crowd dribbling request heads, slow everyone else down?

``stencil bench slowclients [--model DIR|tiny | --url URL] [--clients C] [--requests R]
[--max-tokens M] [--slow-headers 200] [--slow-readers 1] [--header-timeout S] [--send-timeout S]
[--max-itl-ratio 1.1] [--json PATH]``

Rounds of two phases in one run against one server (loopback only; ``--rounds``, 4 by default,
idle first in odd rounds and attacked first in even ones, so that a machine whose speed drifts
during the run tilts both sides alike): **idle**, ``C`` normal clients each
stream ``R`` greedy chat-templated ``/generate`` requests of at most ``M`` tokens (speculation
off), and the gaps between their token events, shared by the tokens of an event (counted by its
logprobs), are the inter-token latencies (ITL); then
**attacked**, the same workload while, from a separate process,

* ``--slow-headers`` connections send a request head one byte a second (and reconnect when the
  server closes them, as an attacker would), and
* ``--slow-readers`` clients ask for a long stream (chat completion, top-20 logprobs: large
  events) on a socket with a 4 KiB receive buffer and read it one byte a second (again when
  dropped).

The attacked phase lasts at least ``max(header, send time-out) + 5`` s and until every slow reader
was dropped once (a stream must fill the server's buffers first; at most ``--max-attack-s``), so
that the server's time-outs are seen to act. Reported: ITL p50 / p90 and TTFT p50 of each phase and the ratio
attacked / idle of the ITL p50, pooled over the rounds (the target: at most ``--max-itl-ratio``),
with each round's own ratio and their spread; for the attackers,
the connections the server closed, with a 408, and how long they were held; for the slow
readers, how long until the server dropped them and what they had read; the server's RSS
before and after (its own server); and afterwards nothing may be left in the engine.

Unless ``--url`` is given, the benchmark starts ``stencil serve`` (default model, or ``tiny``)
with ``--header-timeout`` and ``--send-timeout`` (default 10 s each here, shorter than the
server's defaults so a short run sees them act) and any ``--server-arg``. Exit status 1 if an
invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stencil.benchmarks import soak
from stencil.benchmarks.common import pct

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk through a forest in autumn.", "List some facts about the moon and explain them."]
SLOW_READER_BODY = {"messages": [{"role": "user", "content": "Tell me everything you know about rivers."}],
                    "stream": True, "logprobs": True, "top_logprobs": 20, "temperature": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="server to test (loopback only); default: start one")
    p.add_argument("--model", default=None, help="model directory, or 'tiny' (default: the default model)")
    p.add_argument("--clients", type=int, default=4, help="normal streaming clients")
    p.add_argument("--requests", type=int, default=6, help="requests per normal client and phase")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of a normal request")
    p.add_argument("--slow-headers", type=int, default=200, help="connections sending their head a byte a second")
    p.add_argument("--slow-readers", type=int, default=1, help="clients reading their stream a byte a second")
    p.add_argument("--slow-max-tokens", type=int, default=512, help="tokens a slow reader asks for")
    p.add_argument("--header-timeout", type=float, default=10.0, help="the started server's --header-timeout")
    p.add_argument("--send-timeout", type=float, default=10.0, help="the started server's --send-timeout")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more flag for the started server (repeat; e.g. --server-arg=--threads=2)")
    p.add_argument("--max-attack-s", type=float, default=300.0,
                   help="longest attacked phase while waiting for the slow readers to be dropped (s)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds of an idle and an attacked phase, idle first in odd rounds and attacked first in "
                        "even ones (ITL pooled per phase kind; each round's ratio reported too)")
    p.add_argument("--max-itl-ratio", type=float, default=1.1,
                   help="bound on attacked / idle ITL p50 (0: not checked)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")


# -- normal clients --------------------------------------------------------------------------------

async def _normal_client(ac: httpx.AsyncClient, i: int, args, out: dict) -> None:
    for k in range(args.requests):
        body = {"messages": [{"role": "user", "content": PROMPTS[(i + k) % len(PROMPTS)]}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "speculative": False,
                "logprobs": True}
        t0 = time.perf_counter()
        last, done, status = None, False, None
        async with ac.stream("POST", "/generate", json=body, timeout=600) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if line == "data: [DONE]":
                    done = True
                elif '"type":"delta"' in line:
                    # An event may carry several tokens (a late UTF-8 byte, a lagging reader):
                    # they share its gap, as in the server's own ITL metric.
                    n = max(1, len(json.loads(line[len("data: "):]).get("logprobs") or ()))
                    if last is None:
                        out["ttft"].append(now - t0)
                    else:
                        out["itl"].extend([(now - last) / n] * n)
                    last = now
        out["answered" if status == 200 and done else "failed"] += 1


async def _phase(url: str, args) -> dict:
    out = {"itl": [], "ttft": [], "answered": 0, "failed": 0}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url) as ac:
        await asyncio.gather(*(_normal_client(ac, i, args, out) for i in range(args.clients)))
    out["wall_s"] = time.perf_counter() - t0
    return out


def _summary(phases: list[dict]) -> dict:
    itl = [x for p in phases for x in p["itl"]]
    ttft = [x for p in phases for x in p["ttft"]]
    return {"itl_ms_p50": _ms(pct(itl, 50)), "itl_ms_p90": _ms(pct(itl, 90)), "ttft_ms_p50": _ms(pct(ttft, 50)),
            "itl_samples": len(itl), "answered": sum(p["answered"] for p in phases),
            "failed": sum(p["failed"] for p in phases), "wall_s": round(sum(p["wall_s"] for p in phases), 1)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


# -- the attackers (a process of their own) --------------------------------------------------------

async def _slow_head(host: str, port: int, stop: asyncio.Event, stats: dict) -> None:
    head = (b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 20\r\n"
            b"X-Padding: " % host.encode() + b"a" * 4000 + b"\r\n\r\n")
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            stats["connect_errors"] += 1
            await asyncio.sleep(1.0)
            continue
        stats["opened"] += 1
        t0 = time.monotonic()
        answer = asyncio.ensure_future(reader.read(64))
        try:
            for byte in head:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                stats["bytes_sent"] += 1
                done, _ = await asyncio.wait({answer}, timeout=1.0)
                if done:
                    break
            if answer.done():
                first = answer.result() if not answer.exception() else b""
                stats["closed_by_server"] += 1
                stats["answered_408"] += first.startswith(b"HTTP/1.1 408")
                stats["held_s"].append(time.monotonic() - t0)
        except (ConnectionError, OSError):
            stats["closed_by_server"] += 1
            stats["held_s"].append(time.monotonic() - t0)
        finally:
            answer.cancel()
            writer.close()


async def _slow_reader(host: str, port: int, max_tokens: int, stop: asyncio.Event, stats: dict, drops) -> None:
    loop = asyncio.get_running_loop()
    body = json.dumps({**SLOW_READER_BODY, "max_tokens": max_tokens}).encode()
    while not stop.is_set():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError:
            sock.close()
            await asyncio.sleep(1.0)
            continue
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        stats["streams"] += 1
        t0 = time.monotonic()
        tail, ended = b"", False
        try:
            while not stop.is_set():
                if _peer_closed(sock):
                    ended = True  # reset or closed by the server, bytes still unread here
                    break
                try:
                    byte = await asyncio.wait_for(loop.sock_recv(sock, 1), timeout=1.0)
                except TimeoutError:
                    continue  # nothing sent yet (queued, or still prefilling)
                if not byte:
                    ended = True  # the server closed the connection
                    break
                stats["bytes_read"] += 1
                tail = (tail + byte)[-16:]
                if b"[DONE]" in tail:
                    stats["completed"] += 1
                    break
                await asyncio.sleep(1.0)
        except (ConnectionError, OSError):
            ended = True
        if ended:
            stats["dropped"] += 1
            with drops.get_lock():
                drops.value += 1  # the parent waits on it
            stats["dropped_after_s"].append(time.monotonic() - t0)
        sock.close()


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the server has closed or reset this connection (Linux ``TCP_INFO`` state
    CLOSE or CLOSE_WAIT), though unread bytes may remain in the receive buffer."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in (7, 8)
    except (OSError, AttributeError):
        return False


def _attack(host: str, port: int, heads: int, readers: int, max_tokens: int, stop_evt, drops, conn) -> None:
    """Process body: run the attackers until ``stop_evt``; send their stats over ``conn``."""
    heads_stats = {"opened": 0, "closed_by_server": 0, "answered_408": 0, "bytes_sent": 0, "connect_errors": 0,
                   "held_s": []}
    reader_stats = {"streams": 0, "dropped": 0, "completed": 0, "bytes_read": 0, "dropped_after_s": []}

    async def run() -> None:
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop_evt.is_set():
                await asyncio.sleep(0.2)
            stop.set()

        await asyncio.gather(watch(), *(_slow_head(host, port, stop, heads_stats) for _ in range(heads)),
                             *(_slow_reader(host, port, max_tokens, stop, reader_stats, drops) for _ in range(readers)))

    asyncio.run(run())
    conn.send({"slow_headers": heads_stats, "slow_readers": reader_stats})


class Attack:
    """The attackers in a separate process, so their work is not the measuring loop's."""

    def __init__(self, url: str, args):
        ctx = multiprocessing.get_context("spawn")
        u = httpx.URL(url)
        self._stop = ctx.Event()
        self.drops = ctx.Value("i", 0)  # slow-reader connections the server dropped so far
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_attack, args=(u.host, u.port, args.slow_headers, args.slow_readers,
                                                       args.slow_max_tokens, self._stop, self.drops, send),
                                 daemon=True)

    def start(self) -> "Attack":
        self._proc.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        stats = self._recv.recv() if self._recv.poll(60) else {}
        self._proc.join(10)
        return stats


def _attack_summary(stats: dict, elapsed_s: float) -> dict:
    h, r = stats.get("slow_headers", {}), stats.get("slow_readers", {})
    held = h.pop("held_s", [])
    after = r.pop("dropped_after_s", [])
    return {"attack_s": round(elapsed_s, 1),
            "slow_headers": {**h, "held_s_p50": _round(pct(held, 50)), "held_s_max": _round(max(held, default=None))},
            "slow_readers": {**r, "dropped_after_s": [round(x, 1) for x in after]}}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# -- the run ---------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    soak._raise_fd_limit(args.slow_headers + args.slow_readers + args.clients + 64)
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
        print("stencil bench slowclients: --url must be a loopback address", file=sys.stderr)
        return 2
    server, tmp = None, None
    if args.url is None:
        if args.model == "tiny":
            tmp = tempfile.TemporaryDirectory(prefix="stencil-slow-")
            model = soak._tiny_model(Path(tmp.name))
        elif args.model is None:
            from stencil.engine.models.default_model import ensure_default_model

            model = ensure_default_model()
        else:
            model = Path(args.model)
        ns = argparse.Namespace(max_tokens=max(args.max_tokens, args.slow_max_tokens), num_kv_blocks=None,
                                max_num_seqs=None, max_waiting=None)
        extra = ("--header-timeout", str(args.header_timeout), "--send-timeout", str(args.send_timeout),
                 "--speculative", "off", *args.server_arg)
        server = soak.OwnServer(model, ns, extra)
    min_attack_s = max(args.header_timeout, args.send_timeout) + 5.0
    idle, attacked, attacks = [], [], []
    try:
        if server is not None:
            server.wait_ready()
        url = server.url if server is not None else args.url.rstrip("/")
        pid = server.proc.pid if server is not None else None
        asyncio.run(_phase(url, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
        rss_before = soak._rss_mb(pid) if pid else None
        for k in range(args.rounds):
            # Odd rounds idle first, even rounds attacked first: a machine that drifts slower or
            # faster during the run (a shared VM) tilts both sides alike.
            for kind in ("idle", "attacked") if k % 2 == 0 else ("attacked", "idle"):
                _progress(f"round {k + 1}: {kind} phase")
                if kind == "idle":
                    idle.append(asyncio.run(_phase(url, args)))
                    continue
                attack = Attack(url, args).start()
                t0 = time.monotonic()
                time.sleep(2.0)  # the connections are open and dribbling, the readers' buffers filling
                attacked.append(asyncio.run(_phase(url, args)))
                # Then on until the time-outs have acted: every slow reader dropped once (its
                # stream must first fill the server's buffers), within --max-attack-s.
                while time.monotonic() - t0 < args.max_attack_s and (
                        time.monotonic() - t0 < min_attack_s or attack.drops.value < args.slow_readers):
                    time.sleep(0.5)
                attacks.append(_attack_summary(attack.stop(), time.monotonic() - t0))
        rss_after = soak._rss_mb(pid) if pid else None
        health, _ = soak._settle(url)
    finally:
        exit_code = server.stop() if server is not None else None
        if tmp is not None:
            tmp.cleanup()

    e = health["engine"]
    base, under = _summary(idle), _summary(attacked)
    ratio = (under["itl_ms_p50"] / base["itl_ms_p50"]) if base["itl_ms_p50"] and under["itl_ms_p50"] else None
    per_round = []
    for k, (a, b) in enumerate(zip(idle, attacked)):
        i50, a50 = _ms(pct(a["itl"], 50)), _ms(pct(b["itl"], 50))
        per_round.append({"order": "idle, attacked" if k % 2 == 0 else "attacked, idle", "idle_itl_ms_p50": i50,
                          "attacked_itl_ms_p50": a50, "ratio": round(a50 / i50, 4) if i50 and a50 else None})
    round_ratios = sorted(r["ratio"] for r in per_round if r["ratio"] is not None)
    heads = [a["slow_headers"] for a in attacks]
    readers = [a["slow_readers"] for a in attacks]
    invariants = {
        "itl_ratio_within_bound": not args.max_itl_ratio or (ratio is not None and ratio <= args.max_itl_ratio),
        "normal_clients_all_answered": base["failed"] == under["failed"] == 0 and under["answered"] > 0,
        # Every dribbling connection was closed by the server at least once (its header time-out).
        "slow_headers_closed": not args.slow_headers or all(h["closed_by_server"] >= args.slow_headers for h in heads),
        "slow_readers_dropped": not args.slow_readers or all(r["dropped"] >= args.slow_readers for r in readers),
        "nothing_left_in_engine": e["running"] == 0 and e["waiting"] == 0 and health["inflight"] == 0,
        "all_kv_blocks_free": (e["kv_blocks_free"] == e["kv_blocks_total"]
                               and e.get("kv_sliding_blocks_free") == e.get("kv_sliding_blocks_total")),
        "clean_shutdown": server is None or exit_code == 0,
    }
    report = {
        "idle": base, "attacked": under, "itl_p50_ratio": None if ratio is None else round(ratio, 4),
        "rounds_detail": per_round,
        "itl_p50_ratio_spread": [round_ratios[0], round_ratios[-1]] if round_ratios else None,
        "max_itl_ratio": args.max_itl_ratio, "attacks": attacks, "clients": args.clients,
        "requests_per_client": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "server_header_timeout_s": args.header_timeout if server else None,
        "server_send_timeout_s": args.send_timeout if server else None,
        "rss_mb_before": rss_before, "rss_mb_after": rss_after,
        "kv_blocks_free_after": e["kv_blocks_free"], "kv_blocks_total": e["kv_blocks_total"],
        "model": "url" if args.url else (args.model or "default"), "server_exit_code": exit_code,
        "cpu": _cpu_model(), "invariants": invariants,
    }
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    failed = [k for k, ok in invariants.items() if not ok]
    if failed:
        print(f"stencil bench slowclients: invariants failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _progress(msg: str) -> None:
    print(f"stencil bench slowclients: {msg}", file=sys.stderr, flush=True)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
