"""Typed extraction against a running Stencil server, with nothing but httpx and msgspec.

    make serve                      # in one terminal
    python examples/extract.py      # in another (or: --url http://host:port)

The JSON Schema is derived from the ``Person`` type, sent as ``response_schema``; the server
guarantees the output matches it, and msgspec decodes it into a ``Person``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Annotated

import httpx
import msgspec


class Person(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(max_length=40)]
    age: Annotated[int, msgspec.Meta(ge=0, le=150)]
    city: Annotated[str, msgspec.Meta(max_length=40)]


TEXT = "Maria Garcia is a 34-year-old architect who lives in Lisbon and cycles to work."


def extract(url: str, text: str, api_key: str | None = None, max_tokens: int = 64) -> tuple[Person, dict]:
    """Ask the server for a ``Person`` found in ``text``; return it and the raw response."""
    body = {
        "messages": [
            {"role": "system", "content": "Extract the person described by the user as JSON."},
            {"role": "user", "content": text},
        ],
        "response_schema": msgspec.json.schema(Person),
        "max_tokens": max_tokens,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(f"{url.rstrip('/')}/generate", json=body, headers=headers, timeout=120)
    except httpx.TransportError as e:  # nothing listening, or it went away
        raise SystemExit(f"cannot reach a Stencil server at {url} ({e}); start one with `make serve`, "
                         "or pass --url") from None
    if r.status_code != 200:
        raise SystemExit(f"server answered {r.status_code}: {r.text}")
    answer = r.json()
    if not answer["valid"]:
        raise SystemExit(f"no valid answer ({answer['finish_reason']}): {answer['warnings']}")
    return msgspec.convert(answer["output"], Person), answer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="Stencil server (default %(default)s)")
    p.add_argument("--api-key", default=None, help="API key, if the server requires one")
    p.add_argument("--text", default=TEXT, help="text to extract from")
    p.add_argument("--max-tokens", type=int, default=64, help="output token limit (default %(default)s)")
    args = p.parse_args()
    person, answer = extract(args.url, args.text, args.api_key, args.max_tokens)
    print(repr(person))
    print(f"{answer['usage']['completion_tokens']} tokens in {answer['timings']['total_ms']:.0f} ms",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
