"""Next-token agreement of Stencil's forward with llama.cpp's (and transformers') on one GGUF.

``stencil bench agreement --model FILE.gguf [--positions 512] [--transformers] --json out/agree.json``

Teacher forcing over a fixed text (default: this repository's README): the text is tokenized
once by ``llama-server``'s ``/tokenize`` (special tokens added as the file says, e.g. Gemma's
BOS), its first ``positions + 1`` tokens are the sequence, and at every position ``i`` each
implementation's greedy next token after ``tokens[:i + 1]`` is compared:

* **llama.cpp**: ``llama-server`` (built from the llama-cpp-python sdist by
  ``benchmarks/peers/build_llama_server.sh`` unless ``--llama-server`` names one) on 127.0.0.1
  with one slot; ``/completion`` with the token prefix, ``n_predict`` 1, ``temperature`` 0 and
  ``n_probs`` 1, its prompt cache on (so each request evaluates one new token);
* **Stencil**: the model as ``stencil serve --model FILE`` loads it (the kernels this CPU gets,
  ``kernel_policy``), one forward over the whole sequence through the paged KV cache in
  ``--chunk``-token prefill chunks, the argmax of every position's logits;
* **transformers** (``--transformers``): ``AutoModelForCausalLM.from_pretrained(gguf_file=)``,
  which dequantizes every tensor to fp32 (the reference on the same weights).

Reported: the fraction of positions where the two top-1 tokens are equal, and, for the
positions where they differ, Stencil's logit margin between the two tokens (a near tie is a
rounding difference; a large margin is a bug). Agreement is a property of the model and the
arithmetic, not of the machine's load; the run takes a few minutes on 2 cores. (The default
text is the README of the checkout, so figures of different commits read different tokens.)

**llama.cpp's own floor.** ``--llama-variant OPTS`` (repeatable) runs llama.cpp again with other
options and reports how often it agrees with its first run, and Stencil with it. llama.cpp's
default arithmetic is noisy at the top-1 level: one int8 term per activation (Q8_0 / Q8_K
blocks), an fp16 KV cache, and flash attention's fp16 query and accumulation; a quantized
matmul turns any rounding difference upstream into whole code steps downstream. Measured on
an AMD EPYC (2026-12-05): ``-fa off`` changed 6-7% of llama.cpp's own top-1 tokens on Gemma 3
270M and SmolLM2 Q4_K_M, ``-t 1`` 2.5% on SmolLM2. Agreement with llama.cpp is bounded by that
floor, not by 1. ``--block-terms 1`` gives Stencil llama.cpp's activation arithmetic (each
matmul then equals ggml's ``vec_dot`` within fp32 rounding) and ``--kv-cache-dtype float16``
its cache; neither raised the agreement, because the rounding differences that remain (sum
orders, flash attention's fp16 accumulation) are amplified the same way.

**The two references against each other.** With ``--transformers`` the report also gives
transformers' agreement with llama.cpp and what it implies: top-1 disagreement counts positions,
so it obeys the triangle inequality, d(Stencil, llama.cpp) >= d(transformers, llama.cpp) -
d(Stencil, transformers). Where transformers and llama.cpp disagree on 7% of positions, an
implementation that agrees with transformers on 99% agrees with llama.cpp on at most 94%: the
two targets (>= 0.99 with transformers, >= 0.98 with llama.cpp) cannot both hold then.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="the .gguf file both implementations read")
    p.add_argument("--positions", type=int, default=512, help="teacher-forced positions compared")
    p.add_argument("--text", type=Path, default=ROOT / "README.md", help="the text teacher-forced")
    p.add_argument("--chunk", type=int, default=256, help="Stencil's prefill chunk (tokens)")
    p.add_argument("--transformers", action="store_true",
                   help="also compare with transformers' forward on the dequantized weights")
    p.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: build one)")
    p.add_argument("--threads", type=int, default=None, help="threads of both (default: the CPU count)")
    p.add_argument("--activation-precision", choices=("exact", "int8"), default=None,
                   help="Stencil's activation precision (EngineConfig.activation_precision: exact = two int8 "
                        "terms, int8 = llama.cpp's one; default: the engine's, exact)")
    p.add_argument("--block-terms", type=int, default=None, choices=[1, 2],
                   help="int8 terms per activation of Stencil's GGUF block layers (the same as "
                        "--activation-precision, by number: 2 exact, 1 int8)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="Stencil's KV cache (auto: what the engine keeps for --model, EngineConfig; "
                        "llama-server keeps float16 unless --llama-args says otherwise)")
    p.add_argument("--llama-args", default="",
                   help="more options of llama-server, in one string (e.g. \"--cache-type-k f32 --cache-type-v f32\")")
    p.add_argument("--llama-variant", action="append", default=[],
                   help="llama-server options of a second llama.cpp run (repeatable, e.g. \"-fa off\" or "
                        "\"-t 1\"): its agreement with the first is llama.cpp's own noise floor")
    p.add_argument("--json", type=Path, default=None, help="where to write the report")


# -- llama.cpp ------------------------------------------------------------------------------------

def _top1(body: dict) -> int:
    """The generated token of a ``/completion`` answer (field names differ across versions)."""
    if body.get("tokens"):
        return int(body["tokens"][0])
    probs = body.get("completion_probabilities") or []
    if probs and "id" in probs[0]:
        return int(probs[0]["id"])
    raise KeyError(f"no generated token id in llama-server's answer (keys {sorted(body)})")


def llama_top1(url: str, tokens: list[int], positions: int) -> list[int]:
    """llama.cpp's greedy next token after each prefix ``tokens[:i + 1]``, ``i < positions``."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(positions):
            r = http.post("/completion", json={"prompt": tokens[: i + 1], "n_predict": 1, "temperature": 0,
                                               "n_probs": 1, "cache_prompt": True, "return_tokens": True})
            r.raise_for_status()
            out.append(_top1(r.json()))
    return out


def llama_tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=60)
    r.raise_for_status()
    return [int(t) if not isinstance(t, dict) else int(t["id"]) for t in r.json()["tokens"]]


# -- Stencil --------------------------------------------------------------------------------------

@torch.inference_mode()
def stencil_logits(model, tokens: list[int], chunk: int, block_size: int = 16,
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp32 logits ``[len(tokens), V]`` of one sequence, prefilled in ``chunk``-token steps
    through a paged KV cache (blocks in order, ``kv_dtype``, default the model's) with the
    engine's attention backend for that cache."""
    from stencil.kernels.attention_backend import AttentionMetadata
    from stencil.kernels.registry import get_backend

    kv_dtype = kv_dtype or model.dtype
    backend = get_backend("auto", "cpu")
    blocks = -(-len(tokens) // block_size)
    shape = (blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
              for _ in range(model.num_layers)]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    rows = []
    for start in range(0, len(tokens), chunk):
        new = tokens[start:start + chunk]
        end = start + len(new)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, len(new)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
            slot_mapping=torch.arange(start, end, dtype=torch.int64), max_query_len=len(new),
            max_seq_len=end, query_start_loc_cpu=[0, len(new)], seq_lens_cpu=[end])
        hidden = model(torch.tensor(new), torch.arange(start, end), caches, meta, backend)
        rows.append(model.compute_logits(hidden).float())
    return torch.cat(rows)


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def compare(ours: torch.Tensor, theirs: list[int]) -> dict:
    """Agreement of ``ours.argmax(-1)`` with ``theirs``; each disagreement's logit margin in
    ours (our top-1's logit minus theirs), relative to the logits' spread at that position."""
    top = ours.argmax(-1).tolist()
    diff = [i for i, (a, b) in enumerate(zip(top, theirs)) if a != b]
    margins = sorted(float((ours[i, top[i]] - ours[i, theirs[i]]) / (ours[i].max() - ours[i].min()))
                     for i in diff)
    return {"positions": len(theirs), "agree": len(theirs) - len(diff),
            "agreement": round(1 - len(diff) / len(theirs), 4), "disagreeing_positions": diff[:50],
            "relative_margins": [round(m, 5) for m in margins[:50]]}


def main(args: argparse.Namespace) -> int:
    from stencil.benchmarks.peers.run import _free_port, _stop, _wait_healthy, build_llama_server
    from stencil.engine.models.loader import load_model
    from stencil.benchmarks.spec import cpu_model

    threads = args.threads or (torch.get_num_threads())
    binary = args.llama_server or build_llama_server()
    base = [str(binary), "-m", str(args.model), "--host", "127.0.0.1", "-t", str(threads),
            "-c", str(args.positions + 64), "--parallel", "1", "--no-webui"]
    cmd = [*base, *shlex.split(args.llama_args)]
    tokens: list[int] = []

    def llama_run(extra: list[str]) -> list[int]:
        """llama.cpp's top-1 at every position, one server with ``extra`` options."""
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([*extra, "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_healthy(f"{url}/health", proc, "llama-server")
            if not tokens:
                tokens.extend(llama_tokenize(url, args.text.read_text())[: args.positions + 1])
                if len(tokens) < args.positions + 1:
                    raise SystemExit(f"{args.text} holds {len(tokens)} tokens, fewer than --positions + 1")
            return llama_top1(url, tokens, args.positions)
        finally:
            _stop(proc)

    theirs = llama_run(cmd)
    variants = {v: llama_run([*base, *shlex.split(v)]) for v in args.llama_variant}
    from stencil.engine.config import ACTIVATION_PRECISIONS

    terms = ACTIVATION_PRECISIONS[args.activation_precision] if args.activation_precision else args.block_terms
    model, _ = load_model(args.model, weights="auto", block_terms=terms)
    torch.set_num_threads(threads)
    kv_dtype = args.kv_cache_dtype
    if kv_dtype == "auto":
        from stencil.engine.config import EngineConfig

        kv_dtype = EngineConfig(model=args.model).validate().kv_cache_dtype
    ours = stencil_logits(model, tokens[: args.positions], args.chunk, kv_dtype=getattr(torch, kv_dtype))
    report = {"command": " ".join(sys.argv), "cpu": cpu_model(), "machine": platform.machine(),
              "model": str(args.model), "kv_cache_dtype": kv_dtype, "block_terms": terms, "llama_server": cmd,
              "llama_cpp": compare(ours, theirs)}
    print(f"{args.model.name}: top-1 agreement with llama.cpp {report['llama_cpp']['agreement']:.4f} "
          f"({report['llama_cpp']['agree']}/{args.positions})")
    if variants:
        report["llama_cpp_variants"] = {}
    for v, top in variants.items():
        same = sum(a == b for a, b in zip(top, theirs))
        row = {"llama_cpp_self_agreement": round(same / args.positions, 4),
               "stencil_agreement": compare(ours, top)["agreement"]}
        report["llama_cpp_variants"][v] = row
        print(f"  llama.cpp with {v!r}: agrees with llama.cpp's first run on {row['llama_cpp_self_agreement']:.4f}, "
              f"with Stencil on {row['stencil_agreement']:.4f}")
    if args.transformers:
        ref = hf_logits(args.model, tokens[: args.positions])
        report["transformers"] = compare(ours, ref.argmax(-1).tolist())
        report["transformers"]["max_rel_logit_error"] = float((ours - ref).abs().max() / ref.abs().max())
        print(f"  with transformers (dequantized fp32): {report['transformers']['agreement']:.4f}, "
              f"max |ours - ref| / max |ref| = {report['transformers']['max_rel_logit_error']:.3g}")
        # The two references against each other. Top-1 disagreement is a distance (positions
        # where two of them differ): d(S, L) >= d(T, L) - d(S, T), so an implementation within
        # d(S, T) of transformers agrees with llama.cpp on at most 1 - d(T, L) + d(S, T).
        both = compare(ref, theirs)["agreement"]
        bound = min(1.0, both + (1 - report["transformers"]["agreement"]))
        report["transformers_vs_llama_cpp"] = {"agreement": both,
                                               "bound_on_llama_cpp_agreement": round(bound, 4)}
        print(f"  transformers with llama.cpp: {both:.4f}; so Stencil, at its agreement with transformers, "
              f"agrees with llama.cpp on at most {bound:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0
