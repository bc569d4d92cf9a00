"""Items of a list as they stream: each line of an invoice, typed, as soon as its closing brace arrives.

    python examples/extract_iter.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec

from stencil.service.client import Client

TEXT = "Invoice 1047: 3 notebooks at 4 EUR, 2 pens at 1 EUR and 1 stapler at 9 EUR."


class Line(msgspec.Struct):
    item: Annotated[str, msgspec.Meta(min_length=1, max_length=16)]
    quantity: Annotated[int, msgspec.Meta(ge=1, le=99)]
    price: Annotated[int, msgspec.Meta(ge=0, le=999)]


class Invoice(msgspec.Struct):
    number: Annotated[int, msgspec.Meta(ge=0, le=99999)]
    lines: Annotated[list[Line], msgspec.Meta(min_length=1, max_length=4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    messages = [{"role": "system", "content": "Extract the invoice as JSON."}, {"role": "user", "content": TEXT}]
    with Client(args.url, timeout=120) as client:
        for n, line in enumerate(client.extract_iter(Invoice, messages, items="lines", max_tokens=args.max_tokens)):
            print(f"line {n}: {line!r}", flush=True)
        print(f"whole answer: {client.last['output']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
