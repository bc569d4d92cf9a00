"""Run a model's decoder layers from C (``kernels/csrc/decoder.c``): one native call a step
instead of ~12 torch and ctypes calls a layer.

``DecoderPlan.build(model, kv_caches, backend)`` reads a loaded ``LlamaForCausalLM`` or
``Gemma3ForCausalLM`` into the C structures once (weights', norms' and caches' addresses, shapes,
kernel pointers) and returns None, with the reason in ``DecoderPlan.last_refusal``, when the
model is not one the C decoder runs:

* activations, norms and the RoPE tables fp32 on CPU; no prompt-row route (``quant.RowRoute``);
* every projection native and quantized: an ``Int4Linear`` whose ``PackedInt4`` is packed for
  VNNI, or a ``QuantLinear`` on the GGUF block kernel with at most four quantized parts (no
  float part); a dense projection (an F32/F16 file, an HF checkpoint) keeps the torch layers;
* the ``cpu`` attention backend with a kernel that takes the cache (fp32, bf16 or fp16, contiguous);
* the C library builds (``STENCIL_NATIVE=0`` or ``STENCIL_DECODER=0`` keep the torch layers).

Both paths call the same kernels in the same order with the same arithmetic between them (fp32
additions, ``layer_ops.glu`` for the gated activation): each row gets the same bits either way,
so a greedy output never depends on which one ran (``tests/engine/test_native_decoder.py`` compares
them bit for bit on every supported architecture and weight kind). The decode steps with and
without it: docs/benchmarks.md, "The decode step in process".

``plan.run(h, tables, meta)`` updates the residual stream ``h`` fp32 ``[T, hidden]`` in place
through every layer; ``tables`` is ``[(cos, sin), (local_cos, local_sin)]`` gathered for the
step's positions (``[T, head_dim / 2]`` each; Gemma's local layers read the second pair). A layer
with a window reads ``meta.for_window()``'s block tables and slots, as the torch layers do (a
hybrid KV cache's window group, whose cache tensors have their own size).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from stencil.kernels import decoder as C
from stencil.kernels import ggml_blocks, native
from stencil.kernels.attention_backend import AttentionMetadata

log = logging.getLogger(__name__)


class DecoderPlan:
    """The C structures of one model and KV cache; see the module docstring.

    Attributes:
        last_refusal: why the latest ``build`` returned None ("" when it did not).
    """

    last_refusal = ""

    def __init__(self, lib: ctypes.CDLL, model: C.Model, layers, keep: list, key: tuple) -> None:
        self._lib, self._model, self._layers, self._keep, self.key = lib, model, layers, keep, key
        self._model_ref = ctypes.byref(model)
        self._workspace: dict[int, int] = {}

    @classmethod
    def build(cls, model, kv_caches, backend) -> "DecoderPlan | None":
        """The plan for ``model`` over ``kv_caches`` and ``backend``, or None (the reason in
        ``last_refusal``)."""
        try:
            return cls._build(model, kv_caches, backend)
        except _Refused as e:
            DecoderPlan.last_refusal = str(e)
            log.info("C decoder off, the torch layers run: %s", e)
            return None

    @classmethod
    def _build(cls, model, kv_caches, backend) -> "DecoderPlan":
        if os.environ.get("STENCIL_DECODER", "1") == "0":
            raise _Refused("STENCIL_DECODER=0")
        if getattr(backend, "name", "") != "cpu":
            raise _Refused(f"attention backend {getattr(backend, 'name', backend)!r} (the C decoder calls 'cpu')")
        if model.dtype != torch.float32 or model.device.type != "cpu":
            raise _Refused(f"activations {model.dtype} on {model.device} (the C decoder runs fp32 on CPU)")
        lib = C.library()
        if lib is None:
            raise _Refused("the native layer library did not build")
        pointers = C.kernel_pointers(backend.kernel)
        if pointers is None:
            raise _Refused(f"attention kernel {backend.kernel!r} not available")
        if getattr(model, "row_route", None) is not None:
            raise _Refused("prompt rows take other weights (prompt_weights)")
        spec = model.spec
        act = _ACTIVATIONS.get(spec.activation)
        if act is None:
            raise _Refused(f"activation {spec.activation!r} (the C decoder has {', '.join(_ACTIVATIONS)})")
        k0 = kv_caches[0][0]
        if not all(backend.supports_cache(k) and backend.supports_cache(v) for k, v in kv_caches):
            raise _Refused("the attention kernel does not take this cache")
        keep: list = []  # tensors whose addresses the structures hold
        layers = (C.Layer * spec.num_layers)()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches)):
            attn, mlp = layer.attn, layer.mlp
            L = layers[i]
            L.attn_in_norm = _norm(layer.input_norm, keep)
            if spec.sandwich_norms:  # Gemma's: the blocks' outputs are normed too
                L.attn_out_norm = _norm(layer.post_attn_norm, keep)
                L.mlp_in_norm = _norm(layer.pre_mlp_norm, keep)
                L.mlp_out_norm = _norm(layer.post_mlp_norm, keep)
            else:
                L.mlp_in_norm = _norm(layer.post_attn_norm, keep)
            if attn.q_norm is not None:
                L.q_norm, L.k_norm = _norm(attn.q_norm, keep), _norm(attn.k_norm, keep)
            for field, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                  ("down", mlp.down_proj)):
                _linear(getattr(L, field), module, pointers, keep, f"layers.{i}.{field}")
            L.k_cache, L.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            L.num_slots = k_cache.shape[0] * k_cache.shape[1]
            L.window = attn.window or 0
            L.table = int(attn.window is not None)  # meta.for_window(): its group's tables, if apart
            L.rope = int(spec.uses_local_rope(i))
            L.scale = attn.scale
        m = C.Model(num_layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads,
                    kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, inter=spec.intermediate_size,
                    act=act, cache_kind=native.CACHE_KINDS[k0.dtype],
                    block_size=k0.shape[1], eps=spec.rms_norm_eps,
                    vnni_gemm=pointers["vnni_gemm"], gguf_quantize=pointers["gguf_quantize"],
                    gguf_gemm=pointers["gguf_gemm"], attention=pointers["attention"],
                    layers=ctypes.cast(layers, ctypes.POINTER(C.Layer)))
        DecoderPlan.last_refusal = ""
        return cls(lib, m, layers, keep, plan_key(kv_caches, backend))

    def run(self, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> None:
        """Every layer over ``h`` fp32 ``[T, hidden]`` (contiguous; updated in place).

        Raises:
            RuntimeError: a kernel refused its arguments (the message names the layer and stage).
        """
        t = h.shape[0]
        if t == 0:
            return
        (cos, sin), (lcos, lsin) = tables[0], tables[-1]
        tabs = [x if x.is_contiguous() else x.contiguous() for x in (cos, sin, lcos, lsin)]
        window = meta.for_window()  # the windowed layers' tables (the same ones with one KV cache group)
        slots = [_as(m.slot_mapping, torch.int64) for m in (meta, window)]
        block_tables = [_as(m.block_tables, torch.int32) for m in (meta, window)]
        starts = _as(meta.query_start_loc, torch.int32)
        lens = _as(meta.seq_lens, torch.int32)
        size = self._workspace.get(t)
        if size is None:
            size = self._workspace[t] = self._lib.stencil_decoder_workspace(self._model_ref, t)
        workspace = torch.empty(size, dtype=torch.uint8)
        step = C.Step(t=t, num_seqs=lens.numel(), max_blocks=block_tables[0].shape[1],
                      threads=torch.get_num_threads(), h=h.data_ptr(), query_start_loc=starts.data_ptr(),
                      seq_lens=lens.data_ptr(), workspace=(workspace.data_ptr() + 63) // 64 * 64,
                      workspace_bytes=size - 64)
        step.cos[0], step.sin[0], step.cos[1], step.sin[1] = (x.data_ptr() for x in tabs)
        for i in range(2):
            step.slots[i], step.block_tables[i] = slots[i].data_ptr(), block_tables[i].data_ptr()
        rc = self._lib.stencil_decoder_forward(self._model_ref, ctypes.byref(step))
        if rc:
            where = f"layer {(-rc - 100) // 10}, stage {(-rc - 100) % 10}" if rc <= -100 else "the step's arguments"
            raise RuntimeError(f"the C decoder refused {where} (T={t})")


def plan_key(kv_caches, backend) -> tuple:
    """What a plan depends on besides the weights: the caches' storage and the backend."""
    return (id(backend), len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())


class _Refused(Exception):
    pass


_ACTIVATIONS = {"silu": C.ACT_SILU, "gelu_tanh": C.ACT_GELU_TANH}  # a spec's ``activation`` -> decoder.c's


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def _norm(module, keep: list) -> int:
    w = module.weight
    if w.dtype != torch.float32 or not w.is_contiguous():
        raise _Refused(f"a norm's weight is {w.dtype}")
    keep.append(w)
    return w.data_ptr()


def _linear(out: C.Linear, module, pointers: dict, keep: list, name: str) -> None:
    """Fill ``out`` from an ``Int4Linear`` (VNNI-packed) or a native ``QuantLinear``."""
    from stencil.engine.models.gguf_layers import FLOAT_TYPES, QuantLinear
    from stencil.engine.models.quant import Int4Linear

    bias = getattr(module, "bias", None)
    if bias is not None:
        bias = bias.float().contiguous()
        keep.append(bias)
        out.bias = bias.data_ptr()
    out.k, out.n = module.in_features, module.out_features
    if isinstance(module, Int4Linear):
        packed = module.native
        if packed is None or not packed.vnni or module.route is not None or not pointers["vnni_gemm"]:
            raise _Refused(f"{name} is not a VNNI-packed int4 layer")
        out.kind, out.ldy = C.KIND_VNNI, packed.num_blocks * 16
        out.codes, out.scales, out.zeros = packed.codes.data_ptr(), packed.scales.data_ptr(), packed.zeros.data_ptr()
        out.planes, out.nblocks = packed.planes, packed.num_blocks
        keep.append(packed)
    elif isinstance(module, QuantLinear):
        parts = module.parts
        if (not module.native or len(parts) > C.MAX_PARTS or any(p.qtype in FLOAT_TYPES for p in parts)
                or not pointers["gguf_gemm"]):
            raise _Refused(f"{name} ({'+'.join(module.qtypes)}) is not on the GGUF block kernel")
        out.kind, out.ldy, out.terms, out.nparts = C.KIND_GGUF, module.out_features, module.terms, len(parts)
        for j, p in enumerate(parts):
            type_id, group, _ = ggml_blocks.BLOCKS[p.qtype]
            out.parts[j] = C.Part(type=type_id, group=group, row_bytes=p.data.shape[1], w=p.data.data_ptr(),
                                  start=p.start, rows=p.stop - p.start)
            keep.append(p.data)
    else:
        raise _Refused(f"{name} is a {type(module).__name__} (dense weights keep the torch layers)")


__all__ = ["DecoderPlan", "plan_key"]
