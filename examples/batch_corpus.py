"""A corpus of short texts through ``stencil batch``, interrupted part-way and resumed.

    stencil serve                                          # in one terminal (the default model)
    python examples/batch_corpus.py                        # 1,000 texts (or: --count 50, --url URL)

It writes one OpenAI batch line a text (``/generate`` with a person ``response_schema``, greedy), then runs
the command you would type::

    stencil batch corpus.jsonl answers.jsonl --url http://127.0.0.1:8000 --concurrency 8

stops it with Ctrl-C (SIGINT) once ``answers.jsonl`` holds ``--stop-at`` of the lines, runs the same command
again (it skips what is already answered), and checks the result: every custom_id answered exactly once, every
answer valid and of the right types. The last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
FIRST = ["Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jonas", "Keiko", "Lena",
         "Mateo", "Nia", "Oskar", "Priya", "Rafael", "Sofia", "Tomas", "Yara"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Haddad", "Silva", "Novak", "Fischer", "Rossi",
        "Bauer", "Jensen", "Costa", "Dubois", "Kaya", "Nguyen"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Nairobi", "Montreal", "Valencia", "Krakow", "Tallinn", "Porto", "Seoul",
          "Lima", "Ghent", "Adelaide", "Bergen", "Cork", "Lyon"]
SENTENCES = ["{name}, {age}, runs a bakery in {city}.",
             "Born {age} years ago, {name} now teaches chemistry in {city}.",
             "{name} ({age}) moved to {city} last spring to work as a nurse.",
             "In {city}, {age}-year-old {name} repairs old bicycles.",
             "The new librarian in {city} is {name}, who is {age}."]


def corpus(count: int, seed: int = 0) -> list[str]:
    """``count`` one-sentence texts about a person: a name, an age and a city each (seeded)."""
    rng = random.Random(seed)
    return [rng.choice(SENTENCES).format(name=f"{rng.choice(FIRST)} {rng.choice(LAST)}", age=rng.randrange(18, 90),
                                         city=rng.choice(CITIES)) for _ in range(count)]


def batch_lines(texts: list[str]) -> list[str]:
    """One ``/generate`` batch line a text (custom_id ``t<n>``)."""
    return [json.dumps({"custom_id": f"t{n}", "method": "POST", "url": "/generate", "body": {
        "messages": [{"role": "system", "content": "Extract the person in the text as JSON: name, age, city."},
                     {"role": "user", "content": text}],
        "response_schema": PERSON_SCHEMA, "max_tokens": 64, "temperature": 0}})
        for n, text in enumerate(texts)]


def stencil_batch(inp: Path, out: Path, url: str, concurrency: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stencil.service.cli", "batch", str(inp), str(out), "--url", url,
           "--concurrency", str(concurrency)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def interrupted_run(inp: Path, out: Path, url: str, concurrency: int, stop_at: int) -> int | None:
    """``stencil batch`` stopped with SIGINT once ``out`` holds ``stop_at`` lines; the lines then on disk, or
    None when it finished first."""
    proc = stencil_batch(inp, out, url, concurrency)
    while lines_in(out) < stop_at and proc.poll() is None:
        time.sleep(0.005)
    if proc.poll() is not None:
        proc.communicate()
        return None
    proc.send_signal(signal.SIGINT)
    proc.communicate()
    return lines_in(out)


def check(out: Path, count: int) -> tuple[int, int, int]:
    """(custom_ids answered, of them valid, custom_ids answered more than once) in ``out``."""
    seen: dict[str, int] = {}
    valid = 0
    for raw in out.read_text(encoding="utf-8").splitlines():
        rec = json.loads(raw)
        seen[rec["custom_id"]] = seen.get(rec["custom_id"], 0) + 1
        response = rec["response"] or {}
        body = response.get("body") if isinstance(response.get("body"), dict) else {}
        person = body.get("output")
        valid += (response.get("status_code") == 200 and body.get("valid") is True and isinstance(person, dict)
                  and isinstance(person.get("name"), str) and type(person.get("age")) is int
                  and isinstance(person.get("city"), str))
    answered = sum(f"t{n}" in seen for n in range(count))
    return answered, valid, sum(n > 1 for n in seen.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Stencil server (default %(default)s)")
    ap.add_argument("--count", type=int, default=1000, help="texts in the corpus")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--stop-at", type=float, default=0.4, help="interrupt once this share of lines is answered")
    ap.add_argument("--folder", type=Path, default=None, help="where the files go (default: a new folder)")
    args = ap.parse_args()

    folder = args.folder or Path(tempfile.mkdtemp(prefix="stencil_corpus_"))
    folder.mkdir(parents=True, exist_ok=True)
    inp, out = folder / "corpus.jsonl", folder / "answers.jsonl"
    inp.write_text("\n".join(batch_lines(corpus(args.count))) + "\n", encoding="utf-8")
    out.unlink(missing_ok=True)

    stop_at = max(1, int(args.count * args.stop_at))
    held = interrupted_run(inp, out, args.url, args.concurrency, stop_at)
    print(f"interrupted with {held} of {args.count} lines answered" if held is not None
          else "the first run finished before the interrupt")
    resumed = stencil_batch(inp, out, args.url, args.concurrency)
    summary, _ = resumed.communicate()
    print(summary.strip())
    if resumed.returncode != 0:
        print(f"stencil batch exited with {resumed.returncode}")
        return 1
    answered, valid, doubles = check(out, args.count)
    print(f"{args.count} texts: {answered} answered, {valid} valid, {doubles} answered twice ({out})")
    return 0 if answered == valid == args.count and not doubles else 1


if __name__ == "__main__":
    raise SystemExit(main())
