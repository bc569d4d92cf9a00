"""Int4 weights from GGUF blocks (stencil.engine.models.quant): the kernel's formula, exact conversion
against gguf's own dequantization, per-layer error bound, and the real SmolLM2 file end to end.

Bound tested per layer (module docstring of ``stencil.engine.models.quant``), with ``u = 2^-8`` the unit
roundoff of bf16 and ``A[n] = sum_p sum_k |x_k| (|c_pnk - 8| |scale_pnk| + |zero_pnk|)``:
``|y_int4 - x @ W.T| <= 2.02 u A + 1.01 u |x @ W.T|`` for one plane, ``3.1 u A`` for two
(each plane's output is rounded to bf16 on its own).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from stencil.engine.models.default_model import gguf_path
from stencil.engine.models.quant import (GROUP, Int4Linear, Int4Planes, RowRoute, concat_planes,
                                 planes_from_blocks, qk_row_order)
from stencil.kernels import native

U = 2.0 ** -8
TYPES = ["Q4_0", "Q4_1", "Q8_0"]
# The int4 kernels: torch's (bf16 scales, fp32 FMAs) and the native ones (kernels/native.py):
# "native" is what this CPU gets (int8 activations where it has AVX512-VNNI), "native_bf16" the
# bf16-activation kernel (STENCIL_VNNI=0).
KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not native.available(), reason="native int4 kernel needs a C compiler and AVX512-BF16")),
    pytest.param("native_bf16", marks=pytest.mark.skipif(
        not native.available(), reason="native int4 kernel needs a C compiler and AVX512-BF16"))]


@pytest.fixture(autouse=True)
def _bf16_kernel(request, monkeypatch):
    """The "native_bf16" cases build their layers with the VNNI kernel turned off."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kernel") == "native_bf16":
        monkeypatch.setenv("STENCIL_VNNI", "0")


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of very different magnitudes and signs, a few constant blocks (d = 0 for Q4_1)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w *= np.exp2(rng.integers(-12, 4, size=(rows, 1))).astype(np.float32)
    w[0, :GROUP] = 0.25
    w[1] += 3.0  # all-positive blocks: m far from 0
    return w


def _blocks(w: np.ndarray, qtype: str) -> np.ndarray:
    return quantize(w, GGMLQuantizationType[qtype])


def _bound(planes: Int4Planes, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    c = planes.codes.float() - 8
    a = (c.abs() * planes.scales.abs().repeat_interleave(GROUP, -1)
         + planes.zeros.abs().repeat_interleave(GROUP, -1))  # [P, N, K]
    big_a = torch.einsum("mk,pnk->mn", x.abs().double(), a.double())
    if planes.codes.shape[0] == 1:
        return 2.02 * U * big_a + 1.01 * U * ref.abs().double()
    return 3.1 * U * big_a


def test_kernel_formula_is_code_minus_8_times_scale_plus_zero():
    # Identity activations read the dequantized weight back; scale 2 and zero 0.5 are exact in
    # bf16, so any other formula (c * s + z, zero at index 0) shows up exactly.
    n, k = 32, 64
    codes = torch.arange(n * k, dtype=torch.int32).reshape(n, k) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.zeros(k // GROUP, n, 2, dtype=torch.bfloat16)
    sz[..., 0], sz[..., 1] = 2.0, 0.5
    w = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), packed, GROUP, sz).T
    assert torch.equal(w.float(), (codes.float() - 8) * 2.0 + 0.5)


@pytest.mark.parametrize("qtype", TYPES)
def test_planes_equal_gguf_dequantize_bit_exact(qtype):
    w = _weights(48, 4 * GROUP, seed=1)
    blocks = _blocks(w, qtype)
    planes = planes_from_blocks(blocks, qtype)
    assert planes.codes.shape == ((2 if qtype == "Q8_0" else 1), 48, 4 * GROUP)
    assert int(planes.codes.max()) <= 15
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]))
    assert torch.equal(planes.dequantize(), want)


def test_planes_refuse_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="Q6_K"):
        planes_from_blocks(np.zeros((2, 210), np.uint8), "Q6_K")
    with pytest.raises(ValueError, match="whole number"):
        planes_from_blocks(np.zeros((2, 19), np.uint8), "Q4_0")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int4_linear_within_bf16_bound_of_dequantized_layer(qtype, rows, kernel):
    n, k = 40, 3 * GROUP  # 40 rows: the kernel wants multiples of 16, so padding is exercised
    w = _weights(n, k, seed=2)
    planes = planes_from_blocks(_blocks(w, qtype), qtype)
    bias = torch.randn(n)
    layer = Int4Linear(planes, bias, native=kernel.startswith("native"))
    assert (layer.native is not None) == (kernel.startswith("native"))
    if layer.native is not None:  # each native case runs the kernel it names
        assert layer.native.vnni == (kernel == "native" and native.vnni_available())
    x = torch.randn(rows, k) * 3
    xb = x.bfloat16().double()  # both kernels read bf16 activations
    ref = (xb @ planes.dequantize().double().T) + bias.double()
    y = layer(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    err = (y.double() - ref).abs()
    if kernel == "torch":  # bf16 scales, zeros and outputs: the module docstring's bound
        bound = _bound(planes, x, (x.double() @ planes.dequantize().double().T)) + 1e-6
        err = (y.double() - (x.double() @ planes.dequantize().double().T + bias.double())).abs()
    elif layer.native.vnni:  # int8 activations (kernels/csrc/vnni_gemm.c): exact integer dot
        # products of the quantized activations, fp32 from there; the zeros meet the fp32 sums of x
        xh = native.reference_activations(x)
        w_full = layer.native.dequantize()[:n]
        zeros = torch.zeros_like(w_full)
        if layer.native.planes == 1:
            zeros = layer.native.zeros.transpose(1, 2).reshape(-1, k // GROUP)[:n].double().repeat_interleave(GROUP, -1)
        ref = xh @ w_full.T + (x.double() - xh) @ zeros.T + bias.double()
        err = (y.double() - ref).abs()
        bound = (k + 4) * 2.0 ** -24 * (xh.abs() @ w_full.abs().T + x.double().abs() @ zeros.abs().T) \
            + 2.0 ** -24 * bias.abs().double()
        # and the activations themselves: within a group's max / 32512 of x
        amax = x.abs().reshape(rows, -1, GROUP).amax(-1).double().repeat_interleave(GROUP, -1)
        assert bool(((xh - x.double()).abs() <= amax / 32512 * 1.0001).all())
    else:  # exact products, fp32 sums over at most K + 4 terms: gamma_(K+4) * A
        c = planes.codes.double() - 8
        a = c.abs() * planes.scales.abs().double().repeat_interleave(GROUP, -1) \
            + planes.zeros.abs().double().repeat_interleave(GROUP, -1)
        bound = (k + 4) * 2.0 ** -24 * torch.einsum("mk,pnk->mn", xb.abs(), a) + 2.0 ** -24 * bias.abs().double()
    assert bool((err <= bound).all()), float((err / bound).max())
    # The bound is not vacuous: rounding is visible but far below the weights' scale.
    assert float(err.max()) > 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_row_route_sends_prompt_rows_to_the_dense_copy_and_output_rows_to_int4(kernel):
    w = _weights(48, 2 * GROUP, seed=3)
    planes = planes_from_blocks(_blocks(w, "Q8_0"), "Q8_0")
    bias = torch.randn(48)
    route = RowRoute()
    native_ = kernel.startswith("native")
    layer, plain = Int4Linear(planes, bias, route=route, native=native_), Int4Linear(planes, bias, native=native_)
    x = torch.randn(9, 2 * GROUP)
    dense = torch.nn.functional.linear(x.bfloat16(), planes.dequantize().bfloat16()).float() + bias
    int4 = plain(x)
    assert not torch.equal(dense, int4)  # the two kernels round differently
    prompt = torch.tensor([True, True, False, True, False, False, True, True, False])
    route.set(prompt)
    mixed = layer(x)
    assert torch.equal(mixed[prompt], dense[prompt]) and torch.equal(mixed[~prompt], int4[~prompt])
    route.set(torch.ones(9, dtype=torch.bool))
    assert torch.equal(layer(x), dense)
    route.set(torch.zeros(9, dtype=torch.bool))
    assert torch.equal(layer(x), int4)
    route.clear()
    assert torch.equal(layer(x), int4)


@pytest.mark.parametrize("kernel", ["dense", *KERNELS])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_each_row_gets_the_same_result_at_any_row_count(kernel, qtype):
    """Batch invariance of every kernel: what a row gets never depends on the rows beside it."""
    planes = planes_from_blocks(_blocks(_weights(96, 4 * GROUP, seed=7), qtype), qtype)
    route = RowRoute()
    layer = Int4Linear(planes, route=route, native=kernel.startswith("native"))
    x = torch.randn(40, 4 * GROUP)

    def run(rows):
        route.set(torch.full((rows.shape[0],), kernel == "dense"))
        return layer(rows)

    alone = torch.cat([run(x[i:i + 1]) for i in range(40)])
    for n in (2, 7, 16, 33, 40):
        assert torch.equal(run(x[:n]), alone[:n])


def test_concat_pads_missing_planes_with_exact_zeros():
    a = planes_from_blocks(_blocks(_weights(16, 2 * GROUP, 4), "Q4_1"), "Q4_1")
    b = planes_from_blocks(_blocks(_weights(8, 2 * GROUP, 5), "Q8_0"), "Q8_0")
    fused = concat_planes([a, b])
    assert fused.codes.shape == (2, 24, 2 * GROUP)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="in_features"):
        concat_planes([a, planes_from_blocks(_blocks(_weights(16, GROUP, 6), "Q4_0"), "Q4_0")])


def test_qk_row_order_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(heads, 2, half, ...).swapaxes(1, 2); our order undoes it.
    heads, half = 3, 4
    hf = torch.arange(heads * 2 * half)
    gguf_rows = hf.reshape(heads, 2, half).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf_rows[qk_row_order(len(hf), heads)], hf)


# -- the real SmolLM2 GGUF -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_gguf():
    from stencil.engine.models.quant import GgufWeights

    if not gguf_path().exists():
        pytest.skip("the default model's GGUF is not in the cache")
    return GgufWeights(gguf_path())


def test_real_tensors_exact_and_in_hf_row_order(real_gguf, default_model_dir):
    from safetensors import safe_open

    st = safe_open(str(default_model_dir / "model.safetensors"), framework="pt")
    cases = [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
             ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight", 3),
             ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight", None)]
    for name, hf_name, heads in cases:
        planes = real_gguf.planes(name)
        assert torch.equal(planes.dequantize(), real_gguf.dequantized(name)), name
        w = planes.dequantize()
        if heads is not None:
            w = w[qk_row_order(w.shape[0], heads)]
        # transformers dequantized the same GGUF into the converted directory.
        assert torch.equal(w, st.get_tensor(hf_name)), name
    # The tied embedding is Q8_0 (two planes); its first rows, against gguf and the checkpoint.
    t = real_gguf.tensors["token_embd.weight"]
    raw = np.asarray(t.data)[:256]
    planes = planes_from_blocks(raw, "Q8_0")
    assert torch.equal(planes.dequantize(), torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)))
    assert torch.equal(planes.dequantize(), st.get_tensor("model.embed_tokens.weight")[:256])


@pytest.fixture(scope="module")
def models(default_model_dir):
    from stencil.engine.models.loader import load_model

    if not gguf_path().exists():
        pytest.skip("the default model's GGUF is not in the cache")
    int4, _ = load_model(default_model_dir, weights="int4", gguf_file=gguf_path(), prompt_weights="bf16")
    fp32, _ = load_model(default_model_dir, weights="fp32")
    return int4, fp32


@pytest.mark.slow
def test_real_layers_within_bound(models, real_gguf):
    int4, fp32 = models
    assert int4.lm_head is not fp32.lm_head and len(list(int4.parameters())) < len(list(fp32.parameters()))
    torch.manual_seed(0)
    cases = [("layers.4.attn.qkv_proj", None), ("layers.11.mlp.down_proj", ["blk.11.ffn_down.weight"])]
    for name, gguf_names in cases:
        x = torch.randn(3, fp32.get_submodule(name).in_features)
        ref = fp32.get_submodule(name)(x)
        y = int4.get_submodule(name)(x)
        if gguf_names is None:
            order = [qk_row_order(576, 9), qk_row_order(192, 3), torch.arange(192)]
            parts = [real_gguf.planes(f"blk.4.attn_{p}.weight") for p in "qkv"]
            planes = concat_planes([Int4Planes(p.codes[:, o], p.scales[:, o], p.zeros[:, o])
                                    for p, o in zip(parts, order)])
        else:
            planes = real_gguf.planes(gguf_names[0])
        assert torch.equal(planes.dequantize(), fp32.get_submodule(name).weight)
        err = (y.double() - ref.double()).abs()
        assert bool((err <= _bound(planes, x, ref) + 1e-5).all()), name


@pytest.mark.slow
def test_int4_logits_do_not_depend_on_rows_in_the_step(models):
    """Batch invariance: a row's logits are bit-identical alone or among 1..33 rows (greedy
    outputs must not change with batching or speculation)."""
    int4, _ = models
    torch.manual_seed(1)
    h = torch.randn(33, 576)
    full = int4.compute_logits(h)
    for rows in (1, 2, 4, 5, 9, 16):
        assert torch.equal(int4.compute_logits(h[:rows]), full[:rows]), rows
    mlp = int4.layers[3].mlp
    full = mlp(h)
    for rows in (1, 3, 8):
        assert torch.equal(mlp(h[:rows]), full[:rows]), rows


@pytest.mark.parametrize("kernel", KERNELS)
def test_column_blocks_give_the_same_bits_as_the_whole_layer(kernel):
    """Q8_0 (two planes), 256 output rows: any set of 64-column blocks, for one row or many."""
    planes = planes_from_blocks(_blocks(_weights(256, 4 * GROUP, seed=11), "Q8_0"), "Q8_0")
    layer = Int4Linear(planes, native=kernel.startswith("native"))
    x = torch.randn(5, 4 * GROUP)
    full = layer(x)
    for blocks in ([0], [3], [1, 2], [0, 3], [0, 1, 2, 3]):
        b = torch.tensor(blocks)
        cols = (b[:, None] * 64 + torch.arange(64)).flatten()
        assert torch.equal(layer.forward_columns(x, b), full[:, cols])
        assert torch.equal(layer.forward_columns(x[2:3], b), full[2:3, cols])
    odd = Int4Linear(planes_from_blocks(_blocks(_weights(80, 4 * GROUP, seed=2), "Q4_0"), "Q4_0"),
                     native=kernel.startswith("native"))
    with pytest.raises(ValueError, match="multiple of 64"):
        odd.forward_columns(x, torch.tensor([0]))


def test_masked_logits_exact_where_allowed_and_minus_inf_in_empty_blocks():
    from stencil.engine.model_runner import SPARSE_BLOCKS, masked_logits
    from stencil.grammar.bitmask import allocate_bitmask, bitmask_to_bool

    vocab = 64 * (SPARSE_BLOCKS + 8)
    planes = planes_from_blocks(_blocks(_weights(vocab, 2 * GROUP, seed=5), "Q4_0"), "Q4_0")
    head = Int4Linear(planes)
    x = torch.randn(4, 2 * GROUP)
    full = head(x)
    mask = allocate_bitmask(4, vocab)  # row 0: everything (dense)
    mask[1] = 0
    mask[1, 5] = 1 << 7  # one token: 5 * 32 + 7
    mask[2] = 0
    mask[2, ::2] = 1  # token 0 of every 64-token block: too many blocks, dense
    mask[3] = 0
    mask[3, 2 * 40 + 1] = -1  # 32 tokens of block 40
    got = masked_logits(head, x, mask, vocab)
    allowed = bitmask_to_bool(mask, vocab)
    assert torch.equal(got[allowed], full[allowed])
    assert got[1, 5 * 32 + 7] == full[1, 5 * 32 + 7] and torch.isinf(got[1, :64]).all()
    assert torch.equal(got[0], full[0]) and torch.equal(got[2], full[2])
    assert torch.equal(got[3, 40 * 64:41 * 64], full[3, 40 * 64:41 * 64]) and torch.isinf(got[3, :40 * 64]).all()


@pytest.mark.slow
def test_real_forward_logits_close_and_same_argmax(models, tokenizer):
    from stencil.kernels.attention_backend import AttentionMetadata
    from stencil.kernels.torch_ref import TorchAttentionBackend

    int4, fp32 = models
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    t = len(ids)
    block = 16
    nb = -(-t // block)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32), seq_lens=torch.tensor([t], dtype=torch.int32),
        block_tables=torch.arange(nb, dtype=torch.int32)[None], slot_mapping=torch.arange(t),
        max_query_len=t, max_seq_len=t, query_start_loc_cpu=[0, t], seq_lens_cpu=[t])
    logits = {}
    prompt = torch.ones(t, dtype=torch.bool)
    for kind, model, mask in (("int4", int4, None), ("int4_bf16_prompt", int4, prompt), ("fp32", fp32, None)):
        caches = [(torch.zeros(nb, block, 3, 64), torch.zeros(nb, block, 3, 64)) for _ in range(30)]
        h = model(torch.tensor(ids), torch.arange(t), caches, meta, TorchAttentionBackend(), prompt_mask=mask)
        logits[kind] = model.compute_logits(h[-1:])
    # The dense bf16 copy for prompt rows really ran (the route is cleared after the forward); the
    # GGUF block layers (where the AVX512 int4 kernels do not build) have no such copy to route to.
    routed = any(isinstance(m, Int4Linear) for m in int4.modules())
    assert torch.equal(logits["int4"], logits["int4_bf16_prompt"]) != routed and int4.row_route.dense is None
    for kind in ("int4", "int4_bf16_prompt"):
        assert int(logits[kind].argmax()) == int(logits["fp32"].argmax()), kind
        rel = (logits[kind] - logits["fp32"]).norm() / logits["fp32"].norm()
        assert float(rel) < 0.05, (kind, float(rel))


@pytest.mark.slow
def test_engine_int4_greedy_agreement_reported_and_constrained_valid(default_model_dir, record_property):
    from stencil.benchmarks.common import is_valid, make_validator, run_closed_loop
    from stencil.benchmarks.weights import _prompt_ids, agreement
    from stencil.benchmarks.workload import extraction_items
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine
    from stencil.engine.request import SamplingParams
    from stencil.grammar.base import GrammarSpec

    if not gguf_path().exists():
        pytest.skip("the default model's GGUF is not in the cache")
    gguf = {"gguf_file": str(gguf_path())}
    engines = {kind: LLMEngine(EngineConfig(model=default_model_dir, weights=kind, kv_cache_gib=0.25,
                                            num_threads=1, extra=gguf))
               for kind in ("fp32", "int4")}
    from stencil.engine.models.kernel_policy import layer_kind

    want = {"int4": "Int4Linear", "blocks": "QuantLinear"}[layer_kind(["Q4_1"])]
    assert type(engines["int4"].runner.model.layers[0].mlp.down_proj).__name__ == want
    items = extraction_items(10, seed=5)
    prompts = _prompt_ids(engines["fp32"].tokenizer, items)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    outs = {kind: [t.token_ids for t in run_closed_loop(eng, prompts, greedy, None, 10)[0]]
            for kind, eng in engines.items()}
    same, prefix = agreement(outs["fp32"], outs["int4"])
    record_property("greedy_agreement", same)
    record_property("greedy_prefix_agreement", prefix)
    print(f"int4 vs fp32 greedy: {same:.2f} of {len(items)} outputs identical, {prefix:.2f} mean matched prefix")
    assert all(len(o) == 24 or o[-1] == engines["int4"].eos_token_id for o in outs["int4"])
    eng = engines["int4"]
    few = items[:4]
    grammars = [eng.grammar.compile(GrammarSpec.json_schema(it.schema)) for it in few]
    params = SamplingParams(max_tokens=200, temperature=0)
    traces, _ = run_closed_loop(eng, prompts[:4], params, grammars, 4)
    # The grammar's promise: every output that finished is valid. (Whether the model finishes
    # within max_tokens is the model's business: a 135M model can loop inside a long field.)
    stopped = [(t, it) for t, it in zip(traces, few) if t.finish_reason == "stop"]
    assert len(stopped) >= 3, [t.text for t in traces]
    for t, it in stopped:
        assert is_valid(t.text, make_validator(it.schema)), t.text
    assert all(t.finish_reason in ("stop", "length") for t in traces)


@pytest.mark.slow
def test_real_prefill_in_chunks_gives_the_same_bits_with_the_native_kernels(models, tokenizer):
    """With the native attention (each row alone over exactly its keys) and the row-invariant
    int4 GEMMs, a prompt read in one chunk or in three gives bit-identical hidden states:
    prefill chunking and prefix caching cannot change a greedy output on the default route
    (prompt rows through int4; the fixture's model keeps a dense bf16 copy, not used here:
    ``prompt_mask=None`` sends every row to int4, as a model loaded with the default does)."""
    from stencil.engine.models.loader import _prompt_route
    from stencil.kernels import native, vec_attention
    from stencil.kernels.attention_backend import AttentionMetadata
    from stencil.kernels.cpu import CpuAttentionBackend

    if not (native.available() or vec_attention.available()):
        pytest.skip("native attention needs a C compiler on x86-64")
    assert _prompt_route("auto") is None and _prompt_route("int4") is None  # the default: int4 prompts
    int4, _ = models
    ids = torch.tensor(tokenizer.encode("Invoice INV-20417 was issued to Aurora Robotics on 2024-03-08 "
                                        "for 1,250.00 EUR; payment is due within thirty days of receipt."))
    t, block = ids.numel(), 16
    nb = -(-t // block)
    backend = CpuAttentionBackend()

    def run(cuts):
        caches = [(torch.zeros(nb, block, 3, 64), torch.zeros(nb, block, 3, 64)) for _ in range(30)]
        outs = []
        for a, b in zip([0, *cuts], [*cuts, t]):
            meta = AttentionMetadata(torch.tensor([0, b - a], dtype=torch.int32), torch.tensor([b], dtype=torch.int32),
                                     torch.arange(nb, dtype=torch.int32)[None], torch.arange(a, b), b - a, b,
                                     [0, b - a], [b])
            outs.append(int4(ids[a:b], torch.arange(a, b), caches, meta, backend, prompt_mask=None))
        return torch.cat(outs)

    whole = run([])
    assert torch.equal(run([7, 20]), whole)
    assert torch.equal(run([16]), whole)


@pytest.mark.slow
def test_real_model_through_gguf_block_layers_keeps_greedy_tokens(models, tokenizer, real_gguf):
    """Every projection (Q/K rows reordered for the llama architecture, q/k/v and gate/up fused)
    and the tied Q8_0 LM head through ``quant.linear_from_gguf`` / ``fuse`` / ``tied_lm_head``
    (the GGUF block kernel, or its torch fallback): the same next tokens as the fp32 model on
    the same dequantized weights, logits within 1e-2 (measured 6e-4)."""
    import copy

    from stencil.kernels.attention_backend import AttentionMetadata
    from stencil.kernels.torch_ref import TorchAttentionBackend

    from stencil.engine.models import quant

    _, fp32 = models
    blocks = copy.deepcopy(fp32)
    spec = blocks.spec

    def layer(name, heads=None):
        t = real_gguf.tensors[name]
        raw = np.asarray(t.data)
        if heads:
            raw = raw[qk_row_order(raw.shape[0], heads).numpy()]
        return quant.linear_from_gguf(t.tensor_type.name, raw, int(t.shape[0]))

    for i, lay in enumerate(blocks.layers):
        lay.attn.qkv_proj = quant.fuse(layer(f"blk.{i}.attn_q.weight", spec.num_heads),
                                       layer(f"blk.{i}.attn_k.weight", spec.num_kv_heads),
                                       layer(f"blk.{i}.attn_v.weight"))
        lay.attn.o_proj = layer(f"blk.{i}.attn_output.weight")
        lay.mlp.gate_up_proj = quant.fuse(layer(f"blk.{i}.ffn_gate.weight"), layer(f"blk.{i}.ffn_up.weight"))
        lay.mlp.down_proj = layer(f"blk.{i}.ffn_down.weight")
    blocks.lm_head = quant.tied_lm_head(real_gguf.embedding())
    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    t, block = len(ids), 16
    nb = -(-t // block)
    meta = AttentionMetadata(torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                             torch.arange(nb, dtype=torch.int32)[None], torch.arange(t), t, t, [0, t], [t])
    out = {}
    for kind, model in (("fp32", fp32), ("blocks", blocks)):
        caches = [(torch.zeros(nb, block, 3, 64), torch.zeros(nb, block, 3, 64)) for _ in range(30)]
        with torch.no_grad():
            out[kind] = model.compute_logits(model(torch.tensor(ids), torch.arange(t), caches, meta,
                                                   TorchAttentionBackend()))
    assert torch.equal(out["blocks"].argmax(-1), out["fp32"].argmax(-1))  # teacher-forced top-1 at every position
    assert float((out["blocks"] - out["fp32"]).norm() / out["fp32"].norm()) < 1e-2
