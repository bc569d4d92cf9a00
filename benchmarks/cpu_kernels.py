"""``stencil bench cpu_kernels``: the native CPU kernels against their torch baselines, same run.

* int4 GEMM (``kernels.native.PackedInt4``: the int8-activation VNNI kernel where the CPU has
  it) against the bf16-activation native kernel (``vnni=False``), torch's
  ``_weight_int4pack_mm_for_cpu`` and a dense bf16 ``F.linear`` (oneDNN) on SmolLM2-135M's
  projection shapes, 1-256 rows (a decode batch, a verification step, a prompt chunk);
* paged attention (``kernels.cpu``) against the torch reference backend (``kernels.torch_ref``)
  and against torch SDPA over dense, unpaged K/V, for decode rows, draft rows and a prefill.

Times are medians of repeated calls in milliseconds (``--threads`` torch/OpenMP threads for
all sides); ``speedup`` is baseline / native (``speedup`` for torch's int4 kernel,
``speedup_vs_bf16_kernel``, ``speedup_vs_dense_bf16``). ``max_err`` is the largest absolute
difference of a kernel's output from the exact fp64 product ``x @ W.T`` (GEMM; ``max_err_bf16_kernel``
for the bf16 one) or from dense SDPA (attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

GEMM_SHAPES = [("qkv 576->960", 576, 960), ("gate_up 576->3072", 576, 3072), ("down 1536->576", 1536, 576)]
GEMM_ROWS = [1, 4, 8, 16, 32, 64, 256]
# (name, sequences, cached tokens, new tokens) with SmolLM2's 9 query / 3 kv heads of 64
ATTENTION_CASES = [("decode b8 ctx500", 8, 499, 1), ("drafts b8 ctx500 q4", 8, 496, 4),
                   ("prefill b1 400", 1, 0, 400)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def gemm_rows(repeats: int) -> list[dict]:
    from kernels.native import PackedInt4

    g = torch.Generator().manual_seed(0)
    rows = []
    for name, k, n in GEMM_SHAPES:
        codes = torch.randint(0, 16, (1, n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(1, n, k // 32, generator=g) * 0.02
        zeros = torch.randn(1, n, k // 32, generator=g) * 0.01
        packed = PackedInt4(codes, scales, zeros)
        bf16 = PackedInt4(codes, scales, zeros, vnni=False)
        w = bf16.dequantize()[:n]  # the layer's own weight (the VNNI layout folds the zero in fp32)
        dense = w.to(torch.bfloat16)
        t_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[0].to(torch.int32), 1)
        sz = torch.stack([scales[0], zeros[0]], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        for m in GEMM_ROWS:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            native_ms = _median_ms(lambda: packed.matmul(x), repeats)
            bf16_ms = _median_ms(lambda: bf16.matmul(xb), repeats)
            torch_ms = _median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, t_packed, 32, sz), repeats)
            dense_ms = _median_ms(lambda: F.linear(xb, dense), repeats)
            exact = x.double() @ w.T
            rows.append({"case": f"{name} rows {m}", "native_kernel": "vnni" if packed.vnni else "bf16",
                         "native_ms": native_ms, "bf16_kernel_ms": bf16_ms, "torch_int4_ms": torch_ms,
                         "dense_bf16_ms": dense_ms, "speedup": torch_ms / native_ms,
                         "speedup_vs_bf16_kernel": bf16_ms / native_ms, "speedup_vs_dense_bf16": dense_ms / native_ms,
                         "max_err": float((packed.matmul(x)[:, :n].double() - exact).abs().max()),
                         "max_err_bf16_kernel": float((bf16.matmul(xb)[:, :n].double() - exact).abs().max())})
    return rows


def attention_rows(repeats: int) -> list[dict]:
    from kernels.base import AttentionMetadata
    from kernels.cpu import CpuAttentionBackend
    from kernels.torch_ref import TorchAttentionBackend

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    rows = []
    for name, batch, cached, q_len in ATTENTION_CASES:
        total = cached + q_len
        per_seq = -(-total // block)
        k_cache = torch.randn(batch * per_seq, block, kv_heads, dim, generator=g)
        v_cache = torch.randn(batch * per_seq, block, kv_heads, dim, generator=g)
        tables = torch.randperm(batch * per_seq, generator=g).to(torch.int32).view(batch, per_seq)
        q = torch.randn(batch * q_len, heads, dim, generator=g)
        starts = [i * q_len for i in range(batch + 1)]
        meta = AttentionMetadata(torch.tensor(starts, dtype=torch.int32),
                                 torch.full((batch,), total, dtype=torch.int32), tables,
                                 torch.zeros(batch * q_len, dtype=torch.long), q_len, total, starts, [total] * batch)
        # Dense, unpaged K/V per sequence for SDPA: [B, Hkv, S, D]
        k_dense = k_cache[tables.long()].reshape(batch, -1, kv_heads, dim)[:, :total].transpose(1, 2).contiguous()
        v_dense = v_cache[tables.long()].reshape(batch, -1, kv_heads, dim)[:, :total].transpose(1, 2).contiguous()
        q_dense = q.view(batch, q_len, heads, dim).transpose(1, 2)
        mask = torch.ones(q_len, total, dtype=torch.bool).tril(diagonal=cached)

        def sdpa():
            return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, scale=0.125,
                                                  enable_gqa=True)

        cpu, ref = CpuAttentionBackend("cpu"), TorchAttentionBackend("cpu")
        native_ms = _median_ms(lambda: cpu.forward(q, k_cache, v_cache, meta, 0.125), repeats)
        ref_ms = _median_ms(lambda: ref.forward(q, k_cache, v_cache, meta, 0.125), repeats)
        sdpa_ms = _median_ms(sdpa, repeats)
        want = sdpa().transpose(1, 2).reshape(batch * q_len, heads, dim)
        err = float((cpu.forward(q, k_cache, v_cache, meta, 0.125) - want).abs().max())
        rows.append({"case": name, "native_ms": native_ms, "torch_ref_ms": ref_ms, "dense_sdpa_ms": sdpa_ms,
                     "speedup_vs_torch_ref": ref_ms / native_ms, "speedup_vs_dense_sdpa": sdpa_ms / native_ms,
                     "max_err": err})
    return rows


def main(args: argparse.Namespace) -> int:
    from kernels import native

    if not native.available():
        print("stencil bench cpu_kernels: the native kernels are not available here "
              "(need a C compiler and an x86 CPU with AVX512-BF16)")
        return 2
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "gemm": gemm_rows(args.repeats), "attention": attention_rows(args.repeats)}
    for r in report["gemm"]:
        print(f"[int4] {r['case']:<28} native ({r['native_kernel']}) {r['native_ms']:.4f} ms  "
              f"bf16 kernel {r['bf16_kernel_ms']:.4f} ms ({r['speedup_vs_bf16_kernel']:.2f}x)  "
              f"torch {r['torch_int4_ms']:.4f} ms ({r['speedup']:.2f}x)  dense bf16 {r['dense_bf16_ms']:.4f} ms "
              f"({r['speedup_vs_dense_bf16']:.2f}x)  max_err {r['max_err']:.1e} vs {r['max_err_bf16_kernel']:.1e}")
    for r in report["attention"]:
        print(f"[attn] {r['case']:<28} native {r['native_ms']:.3f} ms  torch_ref {r['torch_ref_ms']:.3f} ms  "
              f"sdpa {r['dense_sdpa_ms']:.3f} ms  "
              f"{r['speedup_vs_torch_ref']:.2f}x / {r['speedup_vs_dense_sdpa']:.2f}x  "
              f"max_err {r['max_err']:.1e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0
