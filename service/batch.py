"""``stencil batch INPUT.jsonl OUTPUT.jsonl``: many requests from a file, answers to a file.

INPUT holds OpenAI's batch lines (the format of its Batch API and of ``vllm run-batch``), one JSON object a
line::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with ``url`` one of ``ROUTES``. Each line's body is sent through the server's own routes: in process (the app
``stencil serve`` builds, driven by litestar's ``AsyncTestClient``) or to a running server (``--url``). OUTPUT
gets one line per answer, in OpenAI's batch output format::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "req-...", "body": {...}}, "error": null}

A server's error answer (400, 404, 422, ...) is a ``response`` with its status and problem-details body, and
``error`` null, as OpenAI writes it; a line that was never sent (not JSON, a field missing, an unknown url, a
second use of a custom_id) has ``response`` null and ``error`` ``{"code", "message"}``.

Lossless and resumable: each answer is written, flushed and fsync'd as one line the moment it arrives (a
single writer on one event loop, so lines never interleave). A new run on the same OUTPUT first drops a torn
last line (a kill mid-write) and skips every custom_id already answered there. A request that got no answer
at all (connection refused, timed out) or an answer that says "try again" (429, 503) is not written: a later
run sends it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
# Answers that say "not now" rather than "no": not written, so that a later run sends the line again.
RETRY_STATUSES = frozenset({429, 503})
DUPLICATE = "duplicate_custom_id"

# (url, body) -> (status, request id or None, body): one request through the server's routes.
Send = Callable[[str, dict], Awaitable[tuple[int, str | None, Any]]]


class BatchFileError(Exception):
    """OUTPUT holds a complete line that is not a batch output line: it is left as it is (one-line message)."""


@dataclass(slots=True)
class Request:
    """One INPUT line to send: its custom_id, route and JSON body."""

    custom_id: str
    url: str
    body: dict


@dataclass(slots=True)
class Refused:
    """One INPUT line answered without being sent: ``error`` is ``{"code", "message"}``."""

    custom_id: str
    error: dict


def parse_line(text: str, number: int) -> Request | Refused:
    """One INPUT line (``number`` 1-based) as a request to send, or as the error that answers it.

    A line without a usable custom_id is answered under ``line-<number>``.
    """
    fallback = f"line-{number}"
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Refused(fallback, _error("invalid_json", f"line {number} is not JSON: {e}"))
    if not isinstance(obj, dict):
        return Refused(fallback, _error("invalid_line", f"line {number} is not a JSON object"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Refused(fallback, _error("invalid_line", f"line {number} has no custom_id (a non-empty string)"))
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return Refused(cid, _error("invalid_line", f"line {number}: method must be \"POST\", got {method!r}"))
    if url not in ROUTES:
        return Refused(cid, _error("invalid_url", f"line {number}: url must be one of {', '.join(ROUTES)}; "
                                                  f"got {url!r}"))
    if not isinstance(body, dict):
        return Refused(cid, _error("invalid_line", f"line {number}: body must be a JSON object"))
    if body.get("stream"):
        return Refused(cid, _error("invalid_line", f"line {number}: a batch line cannot stream; drop \"stream\""))
    return Request(cid, url, body)


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def output_line(custom_id: str, *, status: int | None = None, request_id: str | None = None, body: Any = None,
                error: dict | None = None) -> dict:
    """An OUTPUT record: ``response`` when the server answered (``status``), else ``error``."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": response, "error": error}


def recover(path: Path, key_of: Callable[[dict], str] | None = None) -> tuple[set[str], Counter]:
    """What OUTPUT already answers, after cutting a torn last line (no newline yet) off the file.

    ``key_of`` reads a line's custom_id from its record (default: its ``custom_id``; ``stencil extract``
    writes ``key``).

    Returns:
        (custom_ids answered, how many duplicate-custom_id error lines each custom_id has).

    Raises:
        BatchFileError: a complete line is not a JSON object with a custom_id (nothing is cut then).
    """
    if not path.exists():
        return set(), Counter()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    done: set[str] = set()
    duplicates: Counter = Counter()
    for number, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            cid = key_of(rec) if key_of is not None else rec["custom_id"]
        except (ValueError, TypeError, KeyError):
            raise BatchFileError(f"{path} line {number} is not a batch output line; "
                                 "pick another OUTPUT or fix that line") from None
        if (rec.get("error") or {}).get("code") == DUPLICATE:
            duplicates[cid] += 1
        else:
            done.add(cid)
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return done, duplicates


def plan(lines: Iterator[str], done: set[str], duplicates: Counter) -> list[Request | Refused]:
    """The INPUT lines still to answer, in order: every custom_id's first line unless ``done``, and an error
    for each later line with the same custom_id beyond those already written (``duplicates``)."""
    seen: Counter = Counter()
    todo: list[Request | Refused] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        item = parse_line(text, number)
        cid = item.custom_id
        seen[cid] += 1
        if seen[cid] == 1:
            if cid not in done:
                todo.append(item)
        elif seen[cid] - 1 > duplicates[cid]:
            todo.append(Refused(cid, _error(DUPLICATE, f"line {number}: custom_id {cid!r} is used by an "
                                                       "earlier line; only the first is sent")))
    return todo


class Writer:
    """OUTPUT opened for appending; ``write`` puts one record on disk (write, flush, fsync) before it returns.
    Called only from the event loop's thread and without an ``await`` inside, so lines never interleave."""

    def __init__(self, path: Path):
        self.file = open(path, "ab")

    def write(self, text: str) -> None:
        """``text``: one line, without its newline."""
        self.file.write(text.encode() + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


@dataclass(slots=True)
class Tally:
    """Counts of this run, for the progress bar and the summary line."""

    skipped: int = 0      # lines already answered in OUTPUT
    done: int = 0         # lines written by this run
    errors: int = 0       # of those: an error line or a status >= 400
    valid: int = 0        # of those: /generate's valid, or any other route's 200
    unanswered: int = 0   # no answer, or 429/503: not written, sent again by a later run
    tokens: int = 0       # completion tokens of the answers
    name: str = "stencil batch"  # the command, in messages
    t0: float = field(default_factory=time.perf_counter)

    def record(self, rec: dict, url: str | None) -> None:
        self.done += 1
        response = rec["response"]
        if response is None or response["status_code"] >= 400:
            self.errors += 1
            return
        body = response["body"] if isinstance(response["body"], dict) else {}
        usage = body.get("usage") or {}
        self.tokens += int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        if (body.get("valid") is True) if url == "/generate" else response["status_code"] == 200:
            self.valid += 1

    def postfix(self) -> str:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        share = f"{self.valid / self.done:.0%}" if self.done else "-"
        return f"{self.tokens / wall:.1f} tok/s, valid {share}"

    def summary(self) -> str:
        more = f", {self.unanswered} unanswered (run again to send them)" if self.unanswered else ""
        return (f"{self.name}: {self.done} lines done ({self.skipped} already in OUTPUT), {self.errors} errors"
                f"{more}, {self.tokens} tokens, {time.perf_counter() - self.t0:.1f} s")


def prepare(input_path: Path, output_path: Path) -> tuple[list[Request | Refused], int]:
    """INPUT's lines still to answer (``plan``) and how many lines OUTPUT already holds; a torn last
    line of OUTPUT is cut off (``recover``).

    Raises:
        BatchFileError: OUTPUT holds a line that is not a batch output line.
        OSError, UnicodeDecodeError: INPUT cannot be read.
    """
    done, duplicates = recover(output_path)
    with open(input_path, encoding="utf-8") as f:
        return plan(f, done, duplicates), len(done) + sum(duplicates.values())


async def run_batch(todo: list[Request | Refused], output_path: Path, send: Send, concurrency: int = 8,
                    progress: bool = True, skipped: int = 0, shape: Callable[[dict], str] | None = None,
                    name: str = "stencil batch") -> Tally:
    """Answer ``todo`` (from ``prepare``) into OUTPUT, at most ``concurrency`` requests in flight.

    ``shape`` turns each ``output_line`` record into the line OUTPUT gets (default: the record as JSON);
    ``name`` is the command named in messages.

    Raises:
        OSError: OUTPUT cannot be written.
    """
    from tqdm import tqdm

    tally = Tally(skipped=skipped, name=name)
    writer = Writer(output_path)
    bar = tqdm(total=len(todo), unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)

    def finish(rec: dict, url: str | None) -> None:
        writer.write(shape(rec) if shape is not None else json.dumps(rec, ensure_ascii=False))
        tally.record(rec, url)
        bar.set_postfix_str(tally.postfix(), refresh=False)
        bar.update(1)

    async def answer(req: Request) -> None:
        try:
            status, rid, body = await send(req.url, req.body)
        except Exception as e:  # noqa: BLE001 - no answer at all (refused, timed out): sent again next run
            tally.unanswered += 1
            bar.write(f"{name}: {req.custom_id}: no answer ({type(e).__name__}: {e})")
            return
        if status in RETRY_STATUSES:
            tally.unanswered += 1
            return
        finish(output_line(req.custom_id, status=status, request_id=rid, body=body), req.url)

    items = iter(todo)

    async def worker() -> None:
        for item in items:  # one iterator shared by the workers: each line taken once
            if isinstance(item, Refused):
                finish(output_line(item.custom_id, error=item.error), None)
            else:
                await answer(item)

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    finally:
        bar.close()
        writer.close()
    return tally


def http_sender(client) -> Send:
    """A ``Send`` over an ``httpx.AsyncClient`` (a server's URL, or an ASGI app in process)."""
    async def send(url: str, body: dict) -> tuple[int, str | None, Any]:
        r = await client.post(url, json=body)
        try:
            payload = r.json()
        except ValueError:
            payload = r.text
        return r.status_code, r.headers.get("x-request-id"), payload

    return send


async def run_remote(args, todo: list, skipped: int, api_key: str | None, **kw) -> Tally:
    """``stencil batch --url URL``: the lines go to a running server over HTTP."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(1, args.concurrency))
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=args.request_timeout + 30) as client:
        return await run_batch(todo, args.output, http_sender(client), args.concurrency, skipped=skipped,
                               **kw)


async def run_in_process(args, todo: list, skipped: int, app, api_key: str | None, **kw) -> Tally:
    """``stencil batch`` without ``--url``: the lines go through ``app``'s routes in this process (its
    lifespan loads the model and stops the engine at the end)."""
    from litestar.testing import AsyncTestClient

    print("loading model ...", file=sys.stderr, flush=True)
    # A route's unhandled exception comes back as its 500 answer, as a server would send it, not raised here.
    async with AsyncTestClient(app, base_url="http://stencil.local", timeout=args.request_timeout + 30,
                               raise_server_exceptions=False) as client:
        if api_key:
            client.headers["Authorization"] = f"Bearer {api_key}"
        return await run_batch(todo, args.output, http_sender(client), args.concurrency, skipped=skipped,
                               **kw)


def add_arguments(p) -> None:
    """``stencil batch``'s own arguments (the engine and service ones are the same as ``stencil serve``'s)."""
    p.add_argument("input", type=Path, help="INPUT.jsonl: OpenAI batch lines (custom_id, method, url, body)")
    p.add_argument("output", type=Path, help="OUTPUT.jsonl: answers are appended; custom_ids already there "
                                             "are skipped (resume)")
    p.add_argument("--url", default=None,
                   help="send the lines to a running server (http://127.0.0.1:8000) instead of loading the "
                        "model in this process (the engine options are then ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default: %(default)s)")


def dispatch(args, todo: list[Request | Refused], skipped: int,
             app_factory: Callable[[], tuple[Any, str | None]], **kw) -> Tally:
    """Run ``todo`` to ``args.url``'s server, or in process through ``app_factory()``'s app (loaded only when
    there is something to send); ``kw`` goes to ``run_batch`` (``shape``, ``name``)."""
    if not todo:  # nothing left: no model to load
        return Tally(skipped=skipped, name=kw.get("name", "stencil batch"))
    if args.url is not None:
        api_key = args.api_key or os.environ.get("STENCIL_API_KEY") or None
        return asyncio.run(run_remote(args, todo, skipped, api_key, **kw))
    app, api_key = app_factory()
    return asyncio.run(run_in_process(args, todo, skipped, app, api_key, **kw))


def main(args, app_factory: Callable[[], tuple[Any, str | None]]) -> int:
    """Run ``stencil batch`` from parsed arguments; ``app_factory()`` builds the in-process app and its API key.

    Returns:
        0 when every line has its answer in OUTPUT, 1 when some got none (run again), 2 when a file is unusable.
    """
    if args.input.resolve() == args.output.resolve():
        print("stencil batch: INPUT and OUTPUT are the same file", file=sys.stderr)
        return 2
    if not args.input.is_file():
        why = "no such file" if not args.input.exists() else "not a file"
        print(f"stencil batch: cannot read {args.input}: {why}", file=sys.stderr)
        return 2
    try:
        todo, skipped = prepare(args.input, args.output)
        tally = dispatch(args, todo, skipped, app_factory)
    except (BatchFileError, OSError, UnicodeDecodeError) as e:
        print(f"stencil batch: {e}", file=sys.stderr)
        return 2
    print(tally.summary(), flush=True)
    return 1 if tally.unanswered else 0
