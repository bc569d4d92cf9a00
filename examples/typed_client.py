"""Typed extraction with Stencil's Python client: a type in, an instance of it out.

The JSON Schema is derived from the type (msgspec Struct, dataclass, TypedDict or pydantic
model), the server constrains generation to it, and the answer is decoded into the type.

    python examples/typed_client.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from stencil.service.client import AsyncClient, Client, StencilError

TEXT = "Ada Lovelace, 36, lives in London and writes programs for the Analytical Engine."
OTHERS = ["Grace Hopper, aged 85, lived in Arlington.", "Alan Turing (41) worked in Manchester."]

# Bounded fields keep answers short even from a small model: the grammar enforces the bounds.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=24)]
Age = Annotated[int, msgspec.Meta(ge=0, le=130)]


class Person(msgspec.Struct):
    name: Name
    age: Age
    city: Annotated[str, msgspec.Meta(max_length=24)]


@dataclass
class Job:
    person: Name
    field: Literal["mathematics", "engineering", "music", "other"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    messages = [{"role": "system", "content": "Extract the facts as JSON."},
                {"role": "user", "content": TEXT}]
    with Client(args.url, api_key=args.api_key, timeout=120) as client:
        try:
            person = client.extract(Person, messages, max_tokens=args.max_tokens, seed=0)
            print("Person:", person)
            job = client.extract(Job, messages, max_tokens=args.max_tokens, seed=0)
            print("Job:", job)
            print("Streamed:", end=" ", flush=True)
            for delta in client.stream(TEXT, regex=r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}", max_tokens=16):
                print(delta, end="", flush=True)
            print(f"  (finish_reason={client.last['finish_reason']}, valid={client.last['valid']})")
        except StencilError as e:
            print(f"request failed: {e}")
            return 1

    async def concurrently() -> list[Person]:
        async with AsyncClient(args.url, api_key=args.api_key, timeout=120) as aclient:
            return await asyncio.gather(*(aclient.extract(Person, [messages[0], {"role": "user", "content": t}],
                                                          max_tokens=args.max_tokens) for t in OTHERS))

    for p in asyncio.run(concurrently()):
        print("Async:", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
