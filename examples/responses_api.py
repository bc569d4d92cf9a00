"""OpenAI's Responses API against Stencil: typed output with ``responses.parse``, then a stream.

    python examples/responses_api.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from typing import Literal

from openai import OpenAI
from pydantic import BaseModel, Field


class Invoice(BaseModel):
    number: str = Field(pattern=r"^INV-[0-9]{4}$")
    total: float = Field(ge=0, le=100_000)
    currency: Literal["EUR", "USD", "GBP"]


DOCUMENT = "Invoice INV-2291 from Oslo Tools AS: 3 hammers, total 1,240.50 EUR, due 1 March."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id

    # The grammar makes the output fit Invoice's JSON Schema; the SDK parses it into an Invoice.
    r = client.responses.parse(model=model, instructions="Extract the invoice.", input=DOCUMENT,
                               text_format=Invoice, max_output_tokens=80, temperature=0)
    print("parsed:", repr(r.output_parsed))
    print("status:", r.status, "| tokens in/out:", r.usage.input_tokens, r.usage.output_tokens)

    # Streamed: typed events, text deltas as they are written.
    stream = client.responses.create(model=model, input="Say hello in French.", max_output_tokens=16,
                                     temperature=0, stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
        elif event.type in ("response.completed", "response.incomplete"):
            print(f"\n{event.type}")
    return 0 if isinstance(r.output_parsed, Invoice) else 1


if __name__ == "__main__":
    raise SystemExit(main())
