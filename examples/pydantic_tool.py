"""A tool whose arguments are a nested pydantic model (with an Enum), called through the SDK.

pydantic writes nested models and Enums as ``$defs`` and ``$ref``; Stencil compiles each tool's
parameters as a schema of its own, so the call's arguments fit the model exactly, and the SDK's
``chat.completions.parse`` hands them back as an instance.

    python examples/pydantic_tool.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import enum

import openai
from pydantic import BaseModel, Field


class Priority(enum.Enum):
    low = "low"
    high = "high"


class Contact(BaseModel):
    name: str = Field(max_length=32)
    email: str = Field(pattern=r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org)$")


class CreateTicket(BaseModel):
    """Open a support ticket."""

    title: str = Field(max_length=48)
    priority: Priority
    reporter: Contact


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id

    r = client.chat.completions.parse(
        model=model, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Ana (ana@acme.com) says the login page is down. Urgent."}],
        tools=[openai.pydantic_function_tool(CreateTicket)], tool_choice="required", parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    ticket = call.function.parsed_arguments
    print("called:", call.function.name)
    print("ticket:", repr(ticket))
    return 0 if isinstance(ticket, CreateTicket) and isinstance(ticket.priority, Priority) else 1


if __name__ == "__main__":
    raise SystemExit(main())
