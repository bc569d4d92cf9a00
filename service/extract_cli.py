"""``stencil extract``: one JSON object per document, of a schema or a Python type, to a JSONL or CSV file.

Each document becomes a ``/generate`` request (the prompt template around it as one user message, the schema
as ``response_schema``, greedy by default) and the requests run through ``stencil batch``'s machinery
(``service/batch.py``): in process or to ``--url``, ``--concurrency`` in flight, a progress bar, each line
fsync'd as it comes, and a rerun on the same ``--output`` skips the keys already there.

OUTPUT lines (JSONL)::

    {"key": "a.txt", "output": {...}, "valid": true}
    {"key": 3, "output": null, "valid": false, "error": {"code": "http_422", "message": "..."}}

With ``--csv`` the file is CSV: a header ``key,<the schema's fields>,valid,error`` then one row a document; the
schema must be flat (an object of scalar fields), which is checked before any request.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stencil.service import batch

NAME = "stencil extract"
DEFAULT_PROMPT = ("Extract the information from the text below as a JSON object with the fields of the schema."
                  "\n\nText:\n{text}")
DOC_SUFFIXES = (".txt", ".md")
SCALAR_TYPES = frozenset({"string", "integer", "number", "boolean", "null"})


class ExtractError(Exception):
    """A usage error found before any request (one-line message; exit 2)."""


def add_arguments(p) -> None:
    """``stencil extract``'s own arguments (the engine and service ones are ``stencil serve``'s)."""
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--schema", type=Path, default=None, help="JSON Schema file of one document's output")
    what.add_argument("--type", dest="type_name", default=None, metavar="MODULE:CLASS",
                      help="a pydantic model, msgspec Struct, dataclass or TypedDict whose JSON Schema is used "
                           "(MODULE is imported with the current folder on the path)")
    p.add_argument("--input", default="-",
                   help="a JSONL file (the document is --field; an 'id' field is the key, else the line "
                        "number), a folder of .txt/.md files (key: the file name), or - for stdin (one "
                        "document a line; key: the line number) (default: -)")
    p.add_argument("--field", default="text", help="with a JSONL --input: the field holding the document")
    p.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help="the user message; {text} is replaced by the document (default: asks for the schema's "
                        "fields from the text)")
    p.add_argument("--output", type=Path, required=True,
                   help="OUTPUT file: lines are appended; keys already there are skipped (resume)")
    p.add_argument("--csv", action="store_true", help="write CSV (flat schemas only: scalar fields)")
    p.add_argument("--max-tokens", type=int, default=256, help="most output tokens a document")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--url", default=None,
                   help="send the requests to a running server (http://127.0.0.1:8000) instead of loading the "
                        "model in this process (the engine options are then ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")


def load_schema(args) -> dict:
    """The JSON Schema from ``--schema`` or ``--type``."""
    if args.schema is not None:
        try:
            schema = json.loads(args.schema.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ExtractError(f"cannot read the schema {args.schema}: {e}") from None
        if not isinstance(schema, dict):
            raise ExtractError(f"{args.schema} is not a JSON Schema object")
        return schema
    from stencil.service.client import json_schema_for

    module_name, _, attr = args.type_name.partition(":")
    if not module_name or not attr:
        raise ExtractError(f"--type must be MODULE:CLASS, got {args.type_name!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        tp = importlib.import_module(module_name)
        for part in attr.split("."):
            tp = getattr(tp, part)
    except (ImportError, AttributeError) as e:
        raise ExtractError(f"--type {args.type_name}: {e}") from None
    try:
        return json_schema_for(tp)
    except (TypeError, ValueError) as e:
        raise ExtractError(f"--type {args.type_name} has no JSON Schema: {e}") from None


def flat_fields(schema: dict) -> list[str]:
    """The field names of a flat schema (an object whose properties are scalars, enums or unions of them).

    Raises:
        ExtractError: naming the fields that are not scalars.
    """
    props = schema.get("properties") if schema.get("type", "object") == "object" else None
    if not isinstance(props, dict) or not props:
        raise ExtractError("--csv needs an object schema with properties; write JSONL instead (drop --csv)")
    nested = [name for name, sub in props.items() if not _scalar(sub)]
    if nested:
        raise ExtractError(f"--csv needs scalar fields; not scalar: {', '.join(nested)} "
                           "(write JSONL instead: drop --csv)")
    return list(props)


def _scalar(sub: Any) -> bool:
    if not isinstance(sub, dict):
        return False
    if "const" in sub or "enum" in sub:
        values = sub.get("enum", [sub.get("const")])
        return all(not isinstance(v, (dict, list)) for v in values)
    for key in ("anyOf", "oneOf"):
        if key in sub:
            return all(_scalar(s) for s in sub[key])
    t = sub.get("type")
    types = t if isinstance(t, list) else [t]
    return bool(types) and all(x in SCALAR_TYPES for x in types)


def documents(args) -> list[tuple[Any, str]]:
    """(key, text) of each document of ``--input``, in order."""
    src = args.input
    if src == "-":
        return [(n, line.rstrip("\r\n")) for n, line in enumerate(sys.stdin, 1) if line.strip()]
    path = Path(src)
    try:
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in DOC_SUFFIXES)
            if not files:
                raise ExtractError(f"{path} holds no .txt or .md file")
            return [(f.name, f.read_text(encoding="utf-8")) for f in files]
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ExtractError(f"{path} line {n} is not JSON: {e}") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(args.field), str):
                    raise ExtractError(f"{path} line {n} has no string field {args.field!r} (--field)")
                docs.append((obj.get("id", n), obj[args.field]))
        return docs
    except (OSError, UnicodeDecodeError) as e:
        raise ExtractError(f"cannot read {src}: {e}") from None


def request_lines(docs: list[tuple[Any, str]], args, schema: dict) -> list[str]:
    """The batch lines (``/generate`` with ``response_schema``) of the documents; custom_id: the key as text."""
    lines = []
    for key, text in docs:
        body = {"messages": [{"role": "user", "content": args.prompt.replace("{text}", text)}],
                "response_schema": schema, "max_tokens": args.max_tokens, "temperature": args.temperature}
        lines.append(json.dumps({"custom_id": str(key), "method": "POST", "url": "/generate", "body": body}))
    return lines


def _unless_empty(item, empty: set[str]):
    """``item`` (a planned batch line), or an ``empty_document`` error in its place when its document
    is empty or only whitespace: nothing is sent (a model asked to extract from nothing makes a record up)."""
    if isinstance(item, batch.Request) and item.custom_id in empty:
        return batch.Refused(item.custom_id, {"code": "empty_document", "message": "the document is empty (or only "
                                              "whitespace): nothing to extract from, not sent"})
    return item


def result(rec: dict, keys: dict[str, Any]) -> dict:
    """An extract record from a batch output record: key, output, valid, and error when there is one."""
    key = keys.get(rec["custom_id"], rec["custom_id"])
    response = rec["response"]
    if response is None:
        return {"key": key, "output": None, "valid": False, "error": rec["error"]}
    body = response["body"] if isinstance(response["body"], dict) else {}
    status = response["status_code"]
    if status >= 400:
        message = body.get("detail") or body.get("title") or str(response["body"])
        return {"key": key, "output": None, "valid": False, "error": {"code": f"http_{status}", "message": message}}
    out = {"key": key, "output": body.get("output"), "valid": body.get("valid") is True}
    if not out["valid"]:
        out["error"] = {"code": "invalid_output", "message": f"the output is not valid (finish reason "
                                                             f"{body.get('finish_reason')!r})"}
        out["text"] = body.get("text")
    return out


def _csv_row(values: list) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()[:-1]


def csv_shape(fields: list[str], keys: dict[str, Any]) -> Callable[[dict], str]:
    def shape(rec: dict) -> str:
        r = result(rec, keys)
        output = r["output"] if isinstance(r["output"], dict) else {}
        error = r.get("error")
        cells = [r["key"], *(_cell(output.get(f)) for f in fields), "true" if r["valid"] else "false",
                 f"{error['code']}: {error['message']}" if error else ""]
        return _csv_row(cells)

    return shape


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return v


def recover_csv(path: Path, header: list[str]) -> tuple[set[str], Counter]:
    """What a CSV OUTPUT already answers (as ``batch.recover``), after cutting a torn last line; the header is
    written to a new or empty file.

    Raises:
        ExtractError: the file's header is not ``header`` (another schema's file).
    """
    data = path.read_bytes() if path.exists() else b""
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    if end == 0:
        with open(path, "ab") as f:
            f.write(_csv_row(header).encode() + b"\n")
            os.fsync(f.fileno())
        return set(), Counter()
    rows = list(csv.reader(io.StringIO(data[:end].decode("utf-8"))))
    if rows[0] != header:
        raise ExtractError(f"{path}'s header is {','.join(rows[0])}, not {','.join(header)}; "
                           "pick another --output")
    done: set[str] = set()
    duplicates: Counter = Counter()
    for row in rows[1:]:
        if not row:
            continue
        if row[-1].startswith(batch.DUPLICATE + ":"):
            duplicates[row[0]] += 1
        else:
            done.add(row[0])
    return done, duplicates


def main(args, app_factory: Callable[[], tuple[Any, str | None]]) -> int:
    """Run ``stencil extract`` from parsed arguments (``app_factory`` as ``batch.main``'s).

    Returns:
        0 when every document has its line in OUTPUT, 1 when some got no answer (run again), 2 on a usage
        error (found before any request).
    """
    try:
        if "{text}" not in args.prompt:
            raise ExtractError("--prompt must hold {text}, where the document goes")
        if args.input != "-" and Path(args.input).resolve() == args.output.resolve():
            raise ExtractError("--input and --output are the same file")
        schema = load_schema(args)
        fields = flat_fields(schema) if args.csv else None
        docs = documents(args)
        keys = {str(k): k for k, _ in docs}
        empty = {str(k) for k, text in docs if not text.strip()}
        if fields is not None:
            done, duplicates = recover_csv(args.output, ["key", *fields, "valid", "error"])
            shape = csv_shape(fields, keys)
        else:
            done, duplicates = batch.recover(args.output, key_of=lambda rec: str(rec["key"]))

            def shape(rec: dict) -> str:
                return json.dumps(result(rec, keys), ensure_ascii=False)
        todo = [_unless_empty(item, empty) for item in batch.plan(iter(request_lines(docs, args, schema)), done,
                                                                  duplicates)]
        skipped = len(done) + sum(duplicates.values())
        tally = batch.dispatch(args, todo, skipped, app_factory, shape=shape, name=NAME)
    except (ExtractError, batch.BatchFileError, OSError, UnicodeDecodeError) as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 2
    print(tally.summary(), flush=True)
    return 1 if tally.unanswered else 0
