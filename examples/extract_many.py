"""Many documents at once, each answer checked beyond its schema and re-asked when it fails.

``extract_many`` runs ``concurrency`` extractions at a time and returns them in input order;
``validate`` rejects what a schema cannot say (here: the end year before the start year, a year
or a name that the text does not hold), and the client re-asks with the error, up to ``max_retries`` times.
The hooks print each re-ask and how much of its prompt the server's prefix cache already held.

    stencil serve                                      # in one terminal
    python examples/extract_many.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec

from stencil.service.client import Client

TEXTS = [
    "The Hundred Years' War began in 1337 and ended in 1453.",
    "Construction of the Eiffel Tower started in 1887 and finished in 1889.",
    "The Apollo program ran from 1961 to 1972.",
    "The Thirty Years' War lasted from 1618 until 1648.",
]

Year = Annotated[int, msgspec.Meta(ge=1000, le=2100)]


class Span(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=40)]
    start: Year
    end: Year


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()

    def on_retry(attempt: int, error: BaseException) -> None:
        print(f"  answer {attempt} rejected: {error}")

    def on_response(body: dict, answer: dict) -> None:
        if len(body["messages"]) > 2:  # a re-ask: system, user, then the failed answer and the error
            usage = answer["usage"]
            print(f"  re-ask: {usage['prompt_tokens']} prompt tokens, {usage['cached_tokens']} from the cache")

    def progress(done: int, total: int) -> None:
        print(f"{done}/{total} done")

    texts = [[{"role": "system", "content": "Extract the named period and its start and end years as JSON."},
              {"role": "user", "content": t}] for t in TEXTS]
    with Client(args.url, timeout=120, on_retry=on_retry, on_response=on_response) as client:
        for text, span in zip(TEXTS, client.extract_many(
                Span, texts, concurrency=args.concurrency, progress=progress, return_exceptions=True,
                validate=check, max_retries=2, max_tokens=64)):
            print(f"{text}\n  -> {f'failed: {span}' if isinstance(span, Exception) else span}")
    return 0


def check(span: Span) -> None:
    """What no schema can check: ``ValueError`` (and so a re-ask) when the answer is wrong."""
    if span.end < span.start:
        raise ValueError(f"end ({span.end}) is before start ({span.start})")
    source = next((t for t in TEXTS if span.name in t), None)
    if source is None:
        raise ValueError(f"the name {span.name!r} is not written in the text; copy it from the text")
    if str(span.start) not in source or str(span.end) not in source:
        raise ValueError("the start and end must be years written in the text")


if __name__ == "__main__":
    raise SystemExit(main())
