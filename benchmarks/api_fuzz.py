"""Schema-driven fuzzing of the HTTP API with schemathesis: the checks, shared by the CI test
(``tests/e2e/test_fuzz_api.py``, small and derandomized) and ``stencil bench fuzz`` (any size, random).

The OpenAPI document the server publishes at ``/schema/openapi.json`` is the contract. Each
operation is fuzzed in modes:

* ``positive``: bodies and parameters that follow the document;
* ``negative``: bodies that break it (operations with a body), which must get a 4xx;
* ``servable``: positive bodies mapped onto ones the server can run (one prompt, at most one
  constraint, a few tokens), so cases reach generation, streaming and output checking rather
  than stopping at a 400;
* ``stateful``: sequences that follow the document's links (list the models, then fetch one or
  generate with its id; a response's output items sent back as the next turn's input).

Every answer must never be a 5xx; have a status code, content type, headers and body the
document declares (4xx bodies checked against the problem-details / OpenAI error shapes); and
refuse schema-breaking bodies with a 4xx. Beyond the document: every error names the problem in
words and carries the request id, a 429 says when to retry, and every event of a stream decodes
as one of the documented event types, ending with ``[DONE]``.

``run_mode`` either raises on the first failure (the test: Hypothesis shrinks it) or records
every failure and goes on (the benchmark: a count of failures, each with a curl command that
replays it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, seed as hypothesis_seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.stateful import run_state_machine_as_test
# The built-in OpenAPI checks live here (schemathesis 4.x registers them from this module).
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from stencil.schemas.generate import StreamDelta, StreamError, StreamFinal
from stencil.schemas.openai import ChatCompletionChunk, Completion, ErrorResponse
from stencil.service.openai_api import UNSERVED_CHAT
from stencil.service.responses_api import UNSERVED as UNSERVED_RESPONSES

MODES = ("positive", "negative", "servable", "stateful")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
# Operations that run the model: the ones the "servable" mode maps bodies for.
GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses")
CALL_TIMEOUT_S = 60.0
MAX_STREAM_EVENTS = 100_000  # far beyond any stream of the servers' token caps
MAX_KEPT_FAILURES = 5  # per operation and mode, in the report (all are counted)

_GENERATE_EVENT = msgspec.json.Decoder(StreamDelta | StreamFinal | StreamError)
_STREAM_TYPES = {"/v1/chat/completions": msgspec.json.Decoder(ChatCompletionChunk),
                 "/v1/completions": msgspec.json.Decoder(Completion)}
_OPENAI_ERROR = msgspec.json.Decoder(ErrorResponse)
_RESPONSE_EVENTS = {"response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done",
                    "response.function_call_arguments.delta", "response.function_call_arguments.done",
                    "response.completed", "response.incomplete", "response.failed", "error"}
_SSE_LINE = re.compile(r"\r\n|\r|\n")
_RESPONSE_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def load_api(url: str):
    """The schemathesis schema of the server's published document (``/schema/openapi.json``)."""
    doc = httpx.get(url + "/schema/openapi.json", timeout=30).json()
    api = schemathesis.openapi.from_dict(doc)
    # schemathesis stops reading a stream after 20 events by default (a Responses stream of 16
    # tokens has 24): the checks need every stream whole, so only a stream that goes silent is cut.
    api.config.max_stream_events = MAX_STREAM_EVENTS
    return api


def operations(api, mode: str) -> list[tuple[str, str]]:
    """(path, method) of every documented operation that ``mode`` fuzzes: all for positive and
    stateful, those with a request body for negative, the generating ones for servable."""
    out = []
    for path, item in api.raw_schema["paths"].items():
        for method, op in item.items():
            if method.lower() not in ("get", "post", "put", "patch", "delete"):
                continue
            if mode == "negative" and "requestBody" not in op:
                continue
            if mode == "servable" and (path not in GENERATION_PATHS or method.lower() != "post"):
                continue
            out.append((path, method.upper()))
    return out


def _header(response, name: str) -> str:
    """First value of a header (schemathesis keeps headers as ``{name: [values]}``)."""
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return ""


def check_beyond_schema(path: str, response) -> None:
    """What the document cannot say: errors name the problem; streams are made of documented events.

    Raises:
        AssertionError: saying what is wrong.
    """
    status = response.status_code
    ctype = _header(response, "content-type")
    if status >= 400:
        rid = _header(response, "x-request-id")
        assert rid.startswith("req-"), response.headers
        if path.startswith("/v1"):
            assert _OPENAI_ERROR.decode(response.content).error.message.strip(), response.text
        else:
            problem = msgspec.json.decode(response.content)
            assert problem["detail"].strip() and problem["request_id"] == rid, problem
        if status == 429:
            assert int(_header(response, "retry-after")) >= 1
    if status == 200 and ctype.startswith("text/event-stream"):
        # A stream the client stopped reading (silent past the call's timeout) has no end to check.
        assert not getattr(response, "stream_cut_short", False), "the stream went silent past the call's timeout"
        # SSE breaks lines at CR and LF only (str.splitlines would also break inside a JSON string).
        events = [ln[len("data: "):] for ln in _SSE_LINE.split(response.text) if ln.startswith("data: ")]
        if path == "/v1/responses":
            # OpenAI's Responses streams end with a typed terminal event, not ``[DONE]``.
            assert events and msgspec.json.decode(events[-1])["type"] in _RESPONSE_TERMINAL, response.text[-300:]
            events.append("[DONE]")
        assert events and events[-1] == "[DONE]", response.text[-300:]
        for payload in events[:-1]:
            if path == "/generate":
                event = _GENERATE_EVENT.decode(payload)
                if isinstance(event, StreamError):
                    assert event.error.status < 500, event
            elif path == "/v1/responses":
                event = msgspec.json.decode(payload)
                assert event["type"] in _RESPONSE_EVENTS, event
                assert event["type"] != "error" or event["code"] != "server_error", event
            elif '"error"' in payload[:10]:
                assert _OPENAI_ERROR.decode(payload).error.type != "server_error", payload
            else:
                _STREAM_TYPES[path].decode(payload)


def servable(path: str) -> Callable:
    """Map a generated body onto one the server can run (one prompt, at most one constraint, a
    few tokens), so the fuzzer reaches generation, streaming and output checking."""
    def fix(case):
        body = case.body
        if not isinstance(body, dict):
            return case
        body.pop("model", None)
        for key in ("best_of", "suffix", *UNSERVED_CHAT, *UNSERVED_RESPONSES):
            body.pop(key, None)  # refused by design (400), which the other modes already reach
        for key, top in (("max_tokens", 8), ("max_completion_tokens", 8), ("max_output_tokens", 8), ("n", 2)):
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300:
                body[key] = 1 + int(abs(value)) % top
        if path == "/generate":
            body.pop("messages", None)
            body["prompt"] = "fuzz"
            for key in [k for k in ("response_schema", "regex", "choice") if body.get(k) is not None][1:]:
                body.pop(key)
        elif path == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": "fuzz"}]
        elif path == "/v1/responses":
            body["input"] = "fuzz"
        else:
            body["prompt"] = "fuzz"
        return case
    return fix


@dataclass(slots=True)
class Failure:
    """One failed case: what failed, and a curl command that sends it again."""

    operation: str
    mode: str
    message: str
    curl: str


@dataclass(slots=True)
class Tally:
    """The outcome of fuzzing one operation in one mode (or of the stateful runs)."""

    operation: str
    mode: str
    examples: int = 0
    failures: int = 0
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # failures by kind: schemathesis's names, AssertionError...
    kept: list[Failure] = field(default_factory=list)

    def as_dict(self) -> dict:
        statuses = {str(k): v for k, v in sorted(self.statuses.items(), key=str)}
        return {"operation": self.operation, "mode": self.mode, "examples": self.examples,
                "failures": self.failures, "failure_kinds": dict(self.kinds), "statuses": statuses,
                "kept_failures": [{"message": f.message, "curl": f.curl} for f in self.kept]}


def failure_kinds(exc: BaseException) -> list[str]:
    """What failed, by kind: schemathesis's failure names (``ServerError``, ``JsonSchemaError``,
    ``UndefinedStatusCode``, ``AcceptedNegativeData``...), ``AssertionError`` for the checks
    beyond the document, the transport error's name for no answer."""
    if isinstance(exc, FailureGroup):
        return sorted({type(e).__name__ for e in exc.exceptions})
    return [type(exc).__name__]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FailureGroup):
        return "; ".join(f"{type(e).__name__}: {e}" for e in exc.exceptions)[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


class _Checker:
    """Calls a case, checks the answer, and records (``collect``) or raises what fails."""

    def __init__(self, url: str, tally: Tally, collect: bool, session: requests.Session):
        self.url, self.tally, self.collect, self.session = url, tally, collect, session

    def call(self, case):
        return case.call(base_url=self.url, session=self.session, timeout=CALL_TIMEOUT_S)

    def check(self, case, response) -> None:
        self.tally.examples += 1
        # Stateful runs go through several operations: count each answer by operation there.
        key = f"{case.operation.label} {response.status_code}" if self.tally.mode == "stateful" else \
            response.status_code
        self.tally.statuses[key] += 1
        try:
            case.validate_response(response, checks=CHECKS)
            check_beyond_schema(case.operation.path, response)
        except (Exception, FailureGroup) as e:  # noqa: BLE001 - every failed check is a finding
            if not self.collect:
                raise AssertionError(f"{_describe(e)}\nrequest body: {case.body!r}") from None
            self.record(case, e)

    def record(self, case, exc: BaseException) -> None:
        self.tally.failures += 1
        for kind in failure_kinds(exc):
            self.tally.kinds[kind] += 1
        if len(self.tally.kept) < MAX_KEPT_FAILURES:
            try:
                curl = case.as_curl_command()
            except Exception:  # noqa: BLE001 - the report must still be written
                curl = repr(case.body)
            head, found, tail = curl.rpartition("http://localhost")  # the document names no server
            curl = head + self.url + tail if found else curl
            self.tally.kept.append(Failure(self.tally.operation, self.tally.mode, _describe(exc), curl))

    def call_and_check(self, case) -> None:
        try:
            response = self.call(case)
        except requests.RequestException as e:
            self.tally.examples += 1
            if not self.collect:
                raise AssertionError(f"transport error {e!r}\nrequest body: {case.body!r}") from None
            self.record(case, e)
            return
        self.check(case, response)


def _settings(examples: int, derandomize: bool, collect: bool, **extra) -> settings:
    # Collecting: no shrinking (nothing raises); the seed replays the run instead.
    phases = [Phase.explicit, Phase.generate] if collect else [Phase.explicit, Phase.generate, Phase.shrink]
    return settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
                    suppress_health_check=list(HealthCheck), phases=phases, **extra)


def run_mode(api, url: str, path: str, method: str, mode: str, *, examples: int, seed: int | None = None,
             derandomize: bool = False, collect: bool = False, skip: Callable | None = None) -> Tally:
    """Fuzz one operation in one of ``positive``, ``negative``, ``servable`` (not ``stateful``).

    Args:
        api: from ``load_api``; url: the server's base URL (loopback).
        examples: Hypothesis's ``max_examples`` (an operation without inputs runs once).
        seed: Hypothesis seed (the same seed and arguments replay the same cases); None: random.
        derandomize: the same cases every run (CI), ignoring ``seed``.
        collect: record every failure in the tally and go on; False: raise on the first.
        skip: cases for which it returns true are not sent (a test steering around a defect
            it pins elsewhere); None: every case is sent.

    Raises:
        AssertionError: with ``collect=False``, the first failing case (shrunk).
    """
    operation = api[path][method]
    if mode == "servable":
        strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).map(servable(path))
    else:
        strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
    if skip is not None:
        strategy = strategy.filter(lambda case: not skip(case))
    tally = Tally(f"{method} {path}", mode)
    with requests.Session() as session:
        checker = _Checker(url, tally, collect, session)

        @given(case=strategy)
        @_settings(examples, derandomize, collect)
        def fuzz(case):
            checker.call_and_check(case)

        if seed is not None and not derandomize:
            fuzz = hypothesis_seed(seed)(fuzz)
        fuzz()
    return tally


def run_stateful(api, url: str, *, examples: int, seed: int | None = None, derandomize: bool = False,
                 collect: bool = False, steps: int = 6, skip: Callable | None = None) -> Tally:
    """Fuzz sequences that follow the document's links (``examples`` scenarios of up to ``steps``
    calls each); every answer gets the same checks as in ``run_mode`` (``skip`` too).

    Raises:
        AssertionError: with ``collect=False``, the first failing step.
    """
    tally = Tally("links", "stateful")
    session = requests.Session()
    checker = _Checker(url, tally, collect, session)

    class Machine(api.as_state_machine()):
        def get_call_kwargs(self, case):
            return {"base_url": url, "session": session, "timeout": CALL_TIMEOUT_S}

        def before_call(self, case):
            assume(skip is None or not skip(case))  # a skipped step is discarded, not sent

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            checker.check(case, response)

    if seed is not None and not derandomize:
        Machine = hypothesis_seed(seed)(Machine)

    try:
        run_state_machine_as_test(Machine, settings=_settings(examples, derandomize, collect,
                                                               stateful_step_count=steps))
    except requests.RequestException as e:
        # A step that got no answer at all ends the stateful run (there is nothing to link from).
        if not collect:
            raise AssertionError(f"transport error in a stateful step: {e!r}") from None
        tally.examples += 1
        tally.failures += 1
        tally.kinds[type(e).__name__] += 1
        tally.kept.append(Failure(tally.operation, tally.mode, f"transport error: {e!r}", ""))
    finally:
        session.close()
    return tally

