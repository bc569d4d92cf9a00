"""``stencil bench cpu_kernels``: the native CPU kernels against their torch baselines, same run.

* int4 GEMM (``stencil.kernels.native.PackedInt4``: the int8-activation VNNI kernel where the CPU has
  it) against the bf16-activation native kernel (``vnni=False``), torch's
  ``_weight_int4pack_mm_for_cpu`` and a dense bf16 ``F.linear`` (oneDNN) on SmolLM2-135M's
  projection shapes, 1-256 rows (a decode batch, a verification step, a prompt chunk);
* paged attention (``stencil.kernels.cpu``) against the torch reference backend (``stencil.kernels.torch_ref``)
  and against torch SDPA over dense, unpaged K/V, for decode rows, draft rows and a prefill;
* the GGUF block GEMM (``stencil.kernels.ggml_blocks``: k-quants and the 32-weight types read in place)
  on random valid blocks of SmolLM2's, a Llama-3.2-1B-shaped model's and Gemma 3 270M's projections (``--block-shapes``),
  1-256 rows, against a dense fp32 ``F.linear`` of the same dequantized weight and, for Q4_K,
  torch's int4 kernel on the same weight (Q4_K is exactly int4 with group 32); at 1 row it reports
  the weight bytes streamed per second beside a ``memcpy`` of as many bytes timed in the same run.
  These sections run where their kernels build (the block GEMM wherever a C compiler does).

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


# (name, in_features, out_features)
BLOCK_SHAPES = {
    "smollm2": [("qkv 576->960", 576, 960), ("gate_up 576->3072", 576, 3072), ("down 1536->576", 1536, 576),
                ("head 576->49152", 576, 49152)],
    "1b": [("attn 2048->2048", 2048, 2048), ("up 2048->8192", 2048, 8192), ("down 8192->2048", 8192, 2048),
           ("head 2048->128256", 2048, 128256)],
    # Gemma 3 270M: its Q5_0 / Q8_0 projections and the tied Q8_0 head of 262,144 tokens
    "gemma3": [("q 640->1024", 640, 1024), ("gate_up 640->2048", 640, 2048), ("down 2048->640", 2048, 640),
               ("head 640->262144", 640, 262144)],
}
BLOCK_ROWS = [1, 4, 16, 64, 256]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--block-types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q8_0",
                   help="GGUF types of the block GEMM section (comma-separated; empty: skip it)")
    p.add_argument("--block-shapes", default="smollm2,1b", help="shape sets: smollm2, 1b, gemma3 (comma-separated)")
    p.add_argument("--block-rows", default=",".join(map(str, BLOCK_ROWS)))
    p.add_argument("--block-terms", default="2,1", help="int8 terms per activation to time (2, 1 or both)")


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
    from stencil.kernels.native import PackedInt4

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


def _random_blocks(qtype: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """uint8 ``[n, row_bytes]`` of valid blocks: random codes, fp16 scales about 0.01."""
    from stencil.engine.models.kquants import BLOCK_SHAPES as SHAPES

    weights, nbytes = SHAPES[qtype]
    raw = torch.randint(0, 256, (n, k // weights, nbytes), generator=g, dtype=torch.uint8)
    halves = {"Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}.get(qtype, [0])
    for at in halves:
        h = (torch.randn(n, k // weights, generator=g) * 0.01).to(torch.float16)
        raw[..., at:at + 2] = h.view(torch.uint8).reshape(n, k // weights, 2)
    return raw.reshape(n, -1)


def _int4_baseline(raw: torch.Tensor, k: int):
    """torch's int4 kernel on a Q4_K weight: ``(packed, scales_and_zeros)`` (group 32; codes
    exact, scale ``d sc`` and zero ``8 scale - dmin m``, the latter rounded to bf16)."""
    from stencil.engine.models.kquants import units

    u = units(raw.numpy(), "Q4_K")
    codes = torch.from_numpy(u.codes).to(torch.int32)
    scale = torch.from_numpy(u.scales[:, ::2].copy())
    zero = torch.from_numpy(u.offsets[:, ::2].copy()) + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    return packed, torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)


def block_rows(types: list[str], shape_sets: list[str], row_counts: list[int], repeats: int,
               threads: int, terms_list: list[int]) -> list[dict]:
    """The GGUF block GEMM against dense fp32 and torch int4, plus bytes/s at 1 row vs memcpy."""
    from stencil.engine.models.kquants import dequantize
    from stencil.kernels import ggml_blocks

    g = torch.Generator().manual_seed(2)
    rows = []
    for set_name in shape_sets:
        for name, k, n in BLOCK_SHAPES[set_name]:
            for qtype in types:
                if k % ggml_blocks.BLOCKS[qtype][1]:
                    # as llama-quantize does, a GGUF stores such a matrix in another type
                    print(f"[gguf] {set_name} {name} {qtype}: in_features not whole blocks, skipped")
                    continue
                raw = _random_blocks(qtype, n, k, g)
                group = ggml_blocks.BLOCKS[qtype][1]
                dense = torch.from_numpy(dequantize(raw.numpy(), qtype))  # fp32 [N, K]
                int4 = _int4_baseline(raw, k) if qtype == "Q4_K" else None
                src = torch.empty(raw.numel(), dtype=torch.uint8)
                dst = torch.empty_like(src)
                # big weights: fewer repeats (the head of 1B shapes is 150 MB in Q4_K, 1 GB dense)
                reps = max(3, min(repeats, int(2e9 / max(1, dense.numel() * 4))))
                memcpy_ms = _median_ms(lambda: dst.copy_(src), reps)
                for m, terms in ((m, t) for m in row_counts for t in terms_list):
                    x = torch.randn(m, k, generator=g)
                    block_ms = _median_ms(
                        lambda: ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, group, terms=terms)), reps)
                    dense_ms = _median_ms(lambda: F.linear(x, dense), reps)
                    row = {"case": f"{set_name} {name} {qtype} rows {m} terms {terms}", "type": qtype, "rows": m,
                           "terms": terms,
                           "block_ms": block_ms, "dense_fp32_ms": dense_ms, "speedup_vs_dense_fp32": dense_ms / block_ms,
                           "weight_bytes": raw.numel(), "dense_bytes": dense.numel() * 4, "isa": ggml_blocks.isa()}
                    if int4 is not None:
                        xb = x.to(torch.bfloat16)
                        row["torch_int4_ms"] = _median_ms(
                            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4[0], 32, int4[1]), reps)
                        row["speedup_vs_torch_int4"] = row["torch_int4_ms"] / block_ms
                    if m == 1:
                        row["stream_GBps"] = raw.numel() / block_ms / 1e6
                        row["memcpy_GBps"] = raw.numel() / memcpy_ms / 1e6  # bytes copied per second
                        row["stream_vs_memcpy"] = row["stream_GBps"] / row["memcpy_GBps"]
                    y = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, group, terms=terms)).double()
                    exact = x.double() @ dense.double().T
                    row["max_rel_err"] = float((y - exact).abs().max() / exact.abs().max())
                    rows.append(row)
                    print(_block_line(row), flush=True)
                del dense, int4
    return rows


def _block_line(r: dict) -> str:
    line = (f"[gguf] {r['case']:<48} block ({r['isa']}) {r['block_ms']:.3f} ms  dense fp32 {r['dense_fp32_ms']:.3f} ms "
            f"({r['speedup_vs_dense_fp32']:.2f}x)")
    if "torch_int4_ms" in r:
        line += f"  torch int4 {r['torch_int4_ms']:.3f} ms ({r['speedup_vs_torch_int4']:.2f}x)"
    if "stream_GBps" in r:
        line += f"  streams {r['stream_GBps']:.2f} GB/s vs memcpy {r['memcpy_GBps']:.2f} GB/s ({r['stream_vs_memcpy']:.2f}x)"
    return line + f"  max_rel_err {r['max_rel_err']:.1e}"


def _cpu_model() -> str:
    """``lscpu``'s model name (from /proc/cpuinfo), or the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def attention_rows(repeats: int) -> list[dict]:
    from stencil.kernels.attention_backend import AttentionMetadata
    from stencil.kernels.cpu import CpuAttentionBackend
    from stencil.kernels.torch_ref import TorchAttentionBackend

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
    from stencil.kernels import ggml_blocks, native

    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "cpu": _cpu_model()}
    print(f"cpu: {report['cpu']}, {args.threads} threads")
    types = [t for t in args.block_types.split(",") if t]
    if types and ggml_blocks.available():
        report["gguf_blocks"] = block_rows(types, [s for s in args.block_shapes.split(",") if s],
                                           [int(r) for r in args.block_rows.split(",")], args.repeats, args.threads,
                                           [int(t) for t in args.block_terms.split(",")])
    elif types:
        print(f"stencil bench cpu_kernels: GGUF block kernel not available ({ggml_blocks.unavailable_reason()})")
    if native.available():
        report["gemm"] = gemm_rows(args.repeats)
        report["attention"] = attention_rows(args.repeats)
    else:
        print("stencil bench cpu_kernels: the int4 and attention kernels are not available here "
              "(need a C compiler and an x86 CPU with AVX512-BF16)")
    if len(report) == 2:
        return 2
    for r in report.get("gemm", []):
        print(f"[int4] {r['case']:<28} native ({r['native_kernel']}) {r['native_ms']:.4f} ms  "
              f"bf16 kernel {r['bf16_kernel_ms']:.4f} ms ({r['speedup_vs_bf16_kernel']:.2f}x)  "
              f"torch {r['torch_int4_ms']:.4f} ms ({r['speedup']:.2f}x)  dense bf16 {r['dense_bf16_ms']:.4f} ms "
              f"({r['speedup_vs_dense_bf16']:.2f}x)  max_err {r['max_err']:.1e} vs {r['max_err_bf16_kernel']:.1e}")
    for r in report.get("attention", []):
        print(f"[attn] {r['case']:<28} native {r['native_ms']:.3f} ms  torch_ref {r['torch_ref_ms']:.3f} ms  "
              f"sdpa {r['dense_sdpa_ms']:.3f} ms  "
              f"{r['speedup_vs_torch_ref']:.2f}x / {r['speedup_vs_dense_sdpa']:.2f}x  "
              f"max_err {r['max_err']:.1e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0
