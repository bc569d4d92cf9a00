"""``stencil extract``: a folder, a JSONL file or stdin to one object per document, as JSONL or CSV, resumable,
on the tiny model with greedy decoding (the schema's constraint makes every output valid)."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter

import jsonschema
import pytest

from stencil.service.cli import main
from stencil.service.client import json_schema_for
from extract_types import Person
from service_live import TINY_MODEL_NAME, tiny_live_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
DOCS = {"a.txt": "Ann is 31.", "b.txt": "Bob, aged 47, lives in Oslo.", "c.md": "# Cy\nCy turned 9 today."}


def _engine(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--model-name", TINY_MODEL_NAME, "--num-kv-blocks", "64",
            "--max-num-seqs", "4", "--max-tokens", "40", "--concurrency", "3"]


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for name, text in DOCS.items():
        (d / name).write_text(text)
    (d / "notes.json").write_text("{}")  # neither .txt nor .md: not a document
    return d


def test_folder_to_jsonl_valid_and_resumed(folder, tmp_path, tiny_model_dir, capsys):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(SCHEMA))
    out = tmp_path / "out.jsonl"
    argv = ["extract", "--schema", str(schema_file), "--input", str(folder), "--output", str(out),
            *_engine(tiny_model_dir)]
    assert main(argv) == 0
    records = _read(out)
    assert sorted(r["key"] for r in records) == sorted(DOCS)
    for r in records:
        assert r["valid"] is True and "error" not in r, r
        jsonschema.validate(r["output"], SCHEMA)
    assert "3 lines done (0 already in OUTPUT), 0 errors" in capsys.readouterr().out
    # The second run sends nothing (no model is loaded): the file is as it was.
    before = out.read_bytes()
    assert main(argv) == 0
    assert out.read_bytes() == before
    assert "0 lines done (3 already in OUTPUT)" in capsys.readouterr().out
    # A new document and a torn last line (a kill mid-write): the torn line is cut, only the new one is sent.
    (folder / "d.txt").write_text("Dee is 60.")
    with open(out, "ab") as f:
        f.write(b'{"key": "zz.txt", "outp')
    assert main(argv) == 0
    records = _read(out)
    keys = Counter(r["key"] for r in records)
    assert keys == Counter([*DOCS, "d.txt"])  # no key twice
    assert records[:3] == [json.loads(line) for line in before.decode().splitlines()]
    assert "1 lines done (3 already in OUTPUT)" in capsys.readouterr().out


def test_type_dataclass_from_jsonl_to_csv(tmp_path, tiny_model_dir, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in [
        {"id": "p1", "body": "Ann is 31."}, {"body": "Bob is 47."}, {"id": 7, "body": "Cy is 9."}]) + "\n")
    out = tmp_path / "out.csv"
    argv = ["extract", "--type", "extract_types:Person", "--input", str(docs), "--field", "body", "--csv",
            "--output", str(out), "--prompt", "Who is it? {text}", *_engine(tiny_model_dir)]
    assert main(argv) == 0
    rows = list(csv.reader(io.StringIO(out.read_text())))
    assert rows[0] == ["key", "name", "age", "valid", "error"]
    assert sorted(r[0] for r in rows[1:]) == ["2", "7", "p1"]  # the id, else the line number
    schema = json_schema_for(Person)
    for key, name, age, valid, error in rows[1:]:
        assert (valid, error) == ("true", ""), rows
        jsonschema.validate({"name": name, "age": int(age)}, schema)
    capsys.readouterr()
    assert main(argv) == 0  # resumed: nothing sent, nothing written
    assert list(csv.reader(io.StringIO(out.read_text()))) == rows
    assert "0 lines done (3 already in OUTPUT)" in capsys.readouterr().out


def test_type_dataclass_from_stdin_to_jsonl(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Ann is 31.\n\nBob is 47.\n"))
    out = tmp_path / "out.jsonl"
    assert main(["extract", "--type", "extract_types:Person", "--output", str(out), *_engine(tiny_model_dir)]) == 0
    records = sorted(_read(out), key=lambda r: r["key"])
    assert [r["key"] for r in records] == [1, 3]  # line numbers; the blank line is no document
    schema = json_schema_for(Person)
    for r in records:
        assert r["valid"] is True
        jsonschema.validate(r["output"], schema)


def test_csv_of_a_nested_type_is_refused_before_any_request(tmp_path, folder, capsys):
    out = tmp_path / "out.csv"
    argv = ["extract", "--type", "extract_types:Team", "--input", str(folder), "--csv", "--output", str(out),
            "--url", "http://127.0.0.1:9"]  # nothing listens there: a request would be an unanswered line
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stencil extract: --csv needs scalar fields; not scalar: members (write JSONL instead: "
                   "drop --csv)"]
    assert not out.exists()


def test_usage_errors_exit_2(tmp_path, folder, capsys):
    out = tmp_path / "out.jsonl"
    base = ["extract", "--input", str(folder), "--output", str(out), "--url", "http://127.0.0.1:9"]
    assert main([*base, "--type", "extract_types:Nobody"]) == 2
    assert "extract_types:Nobody" in capsys.readouterr().err
    assert main([*base, "--type", "extract_types:Person", "--prompt", "no placeholder"]) == 2
    assert "{text}" in capsys.readouterr().err
    assert not out.exists()


def test_a_refused_request_is_an_error_line(folder, tmp_path, tiny_model_dir):
    """A max_tokens below the schema's shortest output: the server's refusal is each document's error line."""
    out = tmp_path / "out.jsonl"
    argv = ["extract", "--type", "extract_types:Person", "--input", str(folder), "--output", str(out),
            *_engine(tiny_model_dir), "--max-tokens", "1"]
    assert main(argv) == 0
    records = _read(out)
    assert sorted(r["key"] for r in records) == sorted(DOCS)
    for r in records:
        assert r["output"] is None and r["valid"] is False, r
        assert r["error"]["code"] == "http_400" and "max_tokens" in r["error"]["message"], r


def test_an_empty_document_is_an_error_line_not_a_request(folder, tmp_path, tiny_model_dir, capsys):
    """An empty or whitespace-only file is answered by an ``empty_document`` error (a model asked to extract
    from nothing makes a record up); the others are sent and answered as ever; a rerun sends nothing."""
    (folder / "empty.txt").write_text("")
    (folder / "blank.md").write_text("  \n\t\n")
    out = tmp_path / "out.jsonl"
    argv = ["extract", "--type", "extract_types:Person", "--input", str(folder), "--output", str(out),
            *_engine(tiny_model_dir)]
    assert main(argv) == 0
    records = {r["key"]: r for r in _read(out)}
    assert sorted(records) == sorted([*DOCS, "empty.txt", "blank.md"])
    for key in ("empty.txt", "blank.md"):
        assert records[key]["output"] is None and records[key]["valid"] is False
        assert records[key]["error"]["code"] == "empty_document", records[key]
    assert all(records[k]["valid"] is True for k in DOCS)
    capsys.readouterr()
    assert main(argv) == 0
    assert "0 lines done (5 already in OUTPUT)" in capsys.readouterr().out


def test_url_gives_what_the_in_process_run_gives(folder, tmp_path, tiny_model_dir):
    outs = {}
    for where in ("local", "url"):
        outs[where] = tmp_path / f"{where}.jsonl"
        argv = ["extract", "--type", "extract_types:Person", "--input", str(folder), "--output", str(outs[where]),
                *_engine(tiny_model_dir)]
        if where == "local":
            assert main(argv) == 0
        else:
            with tiny_live_server(tiny_model_dir) as live:
                assert main([*argv, "--url", live.url]) == 0
    local, remote = (sorted(_read(outs[w]), key=lambda r: r["key"]) for w in ("local", "url"))
    assert [r["key"] for r in local] == sorted(DOCS)
    assert all(r["valid"] for r in local)
    assert remote == local
