"""A tool-call round trip with the official ``openai`` package pointed at Stencil.

1. The model is asked a question with a ``get_weather`` tool and must call it once
   (``tool_choice="required"``, ``parallel_tool_calls=False``); Stencil's grammar guarantees the arguments match the
   function's JSON Schema.
2. The function runs here, locally.
3. Its result goes back as a ``tool`` message, and the model writes the final answer.

    python examples/tool_call.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}]


def get_weather(city: str, unit: str) -> dict:
    """Stands in for a real weather service."""
    celsius = 18 + len(city) % 7
    return {"city": city, "temperature": celsius if unit == "celsius" else round(celsius * 9 / 5 + 32),
            "unit": unit, "sky": "clear"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="served model id (default: the first of /v1/models)")
    args = ap.parse_args()

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, timeout=120, max_retries=2)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "user", "content": "What's the weather like in Paris today, in celsius?"}]

    # One question, one call: parallel calls off, so the grammar ends the answer after the call.
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=64, seed=0)
    reply = first.choices[0].message
    print("finish_reason:", first.choices[0].finish_reason)
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        args_ = json.loads(call.function.arguments)
        print(f"model called {call.function.name}({args_})")
        result = get_weather(**args_)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=48, seed=0)
    print("answer:", final.choices[0].message.content)
    return 0 if reply.tool_calls else 1


if __name__ == "__main__":
    raise SystemExit(main())
