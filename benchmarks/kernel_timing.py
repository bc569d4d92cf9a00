"""Time the paged attention backends against dense torch SDPA on the same shapes (CUDA only).

Each case is a uniform batch (``batch`` sequences, each with ``context`` cached tokens and
``q_len`` new ones) so that dense SDPA over contiguous, unpaged K/V is a fair lower bound:
the paged backends read the same K/V through a shuffled block table of 16-token blocks.
Times are medians from ``triton.testing.do_bench`` (milliseconds, L2 flushed between runs);
``max_err`` is the largest absolute difference of the Triton kernel from dense SDPA.

Run: ``python -m stencil.benchmarks.kernel_timing [--json PATH]``. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from stencil.kernels.attention_backend import AttentionMetadata

BLOCK = 16


@dataclass(slots=True)
class Case:
    """One timed shape: ``batch`` sequences of ``context`` cached + ``q_len`` new tokens."""

    name: str
    batch: int
    context: int
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(slots=True)
class Row:
    """Median milliseconds per backend for one case (None: backend unavailable)."""

    case: str
    triton_ms: float | None
    sdpa_ms: float
    torch_ref_ms: float
    flash_ms: float | None
    max_err: float | None


CASES = [
    Case("decode b1 ctx1024 32/8x128", 1, 1023, 1, 32, 8, 128),
    Case("decode b32 ctx1024 32/8x128", 32, 1023, 1, 32, 8, 128),
    Case("decode b128 ctx1024 32/8x128", 128, 1023, 1, 32, 8, 128),
    Case("decode b128 ctx1024 9/3x64", 128, 1023, 1, 9, 3, 64),
    Case("draft4 b32 ctx1024 32/8x128", 32, 1020, 4, 32, 8, 128),
    Case("prefill b4 512 32/8x128", 4, 0, 512, 32, 8, 128),
    Case("prefill b1 4096 32/8x128", 1, 0, 4096, 32, 8, 128),
]


def build(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    """Dense Q/K/V ``[B, heads, L, D]`` and the same K/V in a shuffled paged cache."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = case.context + case.q_len
    shape_kv = (case.batch, case.kv_heads, total, case.head_dim)
    q = torch.randn(case.batch, case.heads, case.q_len, case.head_dim, generator=g,
                    device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=g, device=device, dtype=dtype)
    blocks_per_seq = -(-total // BLOCK)
    num_blocks = case.batch * blocks_per_seq
    order = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    tables = order.view(case.batch, blocks_per_seq)
    pos = torch.arange(total, device=device)
    slots = (tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK)  # [B, total]
    cache_shape = (num_blocks * BLOCK, case.kv_heads, case.head_dim)
    k_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[slots.flatten()] = k.transpose(1, 2).reshape(-1, case.kv_heads, case.head_dim)
    v_cache[slots.flatten()] = v.transpose(1, 2).reshape(-1, case.kv_heads, case.head_dim)
    k_cache = k_cache.view(num_blocks, BLOCK, case.kv_heads, case.head_dim)
    v_cache = v_cache.view(num_blocks, BLOCK, case.kv_heads, case.head_dim)
    starts = [i * case.q_len for i in range(case.batch + 1)]
    lens = [total] * case.batch
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.contiguous(),
        slot_mapping=slots[:, case.context:].flatten(),
        max_query_len=case.q_len,
        max_seq_len=total,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    flat_q = q.transpose(1, 2).reshape(-1, case.heads, case.head_dim).contiguous()
    return q, k, v, flat_q, k_cache, v_cache, meta


def dense_sdpa(q, k, v, case: Case) -> torch.Tensor:
    """Bottom-right causal SDPA on contiguous K/V: ``[B, heads, q_len, D]``."""
    total = case.context + case.q_len
    if case.q_len == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if case.context == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = (torch.arange(total, device=q.device)[None, :]
            <= torch.arange(case.q_len, device=q.device)[:, None] + case.context)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _optional_backend(module: str, cls: str):
    try:
        mod = __import__(module, fromlist=[cls])
        return getattr(mod, cls)("cuda")
    except (ImportError, RuntimeError):
        return None


def time_case(case: Case, dtype: torch.dtype) -> Row:
    from triton.testing import do_bench

    from stencil.kernels.torch_ref import TorchAttentionBackend

    q, k, v, flat_q, k_cache, v_cache, meta = build(case, dtype, "cuda")
    scale = case.head_dim ** -0.5
    triton_backend = _optional_backend("stencil.kernels.triton", "TritonAttentionBackend")
    flash_backend = _optional_backend("stencil.kernels.flash", "FlashAttentionBackend")
    torch_backend = TorchAttentionBackend("cuda")

    def paged(backend):
        return lambda: backend.forward(flat_q, k_cache, v_cache, meta, scale)

    sdpa_ms = do_bench(lambda: dense_sdpa(q, k, v, case))
    ref_ms = do_bench(paged(torch_backend))
    triton_ms = max_err = flash_ms = None
    if triton_backend is not None:
        out = paged(triton_backend)()
        dense = dense_sdpa(q, k, v, case).transpose(1, 2).reshape(out.shape)
        max_err = (out.float() - dense.float()).abs().max().item()
        triton_ms = do_bench(paged(triton_backend))
    if flash_backend is not None and dtype != torch.float32:
        flash_ms = do_bench(paged(flash_backend))
    return Row(f"{case.name} {str(dtype).removeprefix('torch.')}", triton_ms, sdpa_ms, ref_ms,
               flash_ms, max_err)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    head = (f"{'case':<38} {'triton ms':>10} {'sdpa ms':>9} {'torch_ref ms':>12} "
            f"{'flash ms':>9} {'triton/sdpa':>11} {'max_err':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = None if r.triton_ms is None else r.triton_ms / r.sdpa_ms
        lines.append(f"{r.case:<38} {_fmt(r.triton_ms):>10} {_fmt(r.sdpa_ms):>9} "
                     f"{_fmt(r.torch_ref_ms):>12} {_fmt(r.flash_ms):>9} {_fmt(ratio, '.2f'):>11} "
                     f"{_fmt(r.max_err, '.1e'):>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_timing needs a CUDA device")
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for case in CASES:
            rows.append(time_case(case, dtype))
            print(f"timed {rows[-1].case}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; median ms (do_bench)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
