"""Load a model from what ``--model`` names: a GGUF file (or a directory holding one), or an
HF-format directory (config.json + safetensors); ``source.resolve_model_path`` tells which.

From a GGUF (``load_gguf_model``), everything comes from the file: the architecture from its
metadata (``gguf_config``), the weights from its tensors (``gguf_weights``): on CPU every
quantized matrix stays quantized, the kernel chosen by ``kernel_policy.layer_kind``:

* Q4_0/Q4_1/Q8_0 projections (and LM head) on a CPU where ``stencil.kernels.native`` builds (x86 with
  AVX512-BF16): int4 planes on its VNNI / bf16 kernels, measured faster than torch's there
  (the default model's greedy outputs on such machines are those of before);
* every other quantized matrix, and those types on any other CPU (AVX2 only, as this project's
  AMD EPYC machines): the file's own blocks, read in place by ``csrc/gguf_gemm.c``
  (``stencil.kernels.ggml_blocks``) with two int8 terms per activation (``kernel_policy.BLOCK_TERMS``);
* the embedding as a ``QuantEmbedding`` and a tied LM head over the same bytes.

Everything else (norms, float matrices) is decoded to ``dtype``.

The config is read with ``transformers.AutoConfig``; weights are read straight from the
safetensors files (every shard named by ``model.safetensors.index.json`` when present) and
mapped onto our fused parameters: ``q_proj``/``k_proj``/``v_proj`` rows are stacked into
``qkv_proj`` and ``gate_proj``/``up_proj`` into ``gate_up_proj``. Unfused tensors are used as
read (no copy when dtype and device already match).

With ``weights="int4"`` the projections and LM head are instead built from the model's GGUF
file by the same rule (int4 planes where the AVX512 kernels build, else the blocks as they are),
and only the rest (embedding, norms, float tensors) is read from the safetensors. The GGUF is
named by ``gguf_file=``, else by ``stencil.json``'s ``"gguf_file"`` in the model directory
(written by the tests' transformers copy of the default model, ``tests/reference_model.py``), else it is the
one ``*.gguf`` in the directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from stencil.engine.models import registry
from stencil.engine.models.llama import LlamaForCausalLM
from stencil.engine.models.source import resolve_model_path

INDEX_FILE = "model.safetensors.index.json"
META_FILE = "stencil.json"  # our notes next to a converted model: {"gguf_file": path}
_Q4 = frozenset({"Q4_0", "Q4_1"})


def load_model(model_dir: Path | str, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", weights: str = "fp32",
               gguf_file: Path | str | None = None, prompt_weights: str = "auto", block_terms: int | None = None):
    """Build our model from ``model_dir`` and fill its weights.

    Args:
        model_dir: a ``.gguf`` file or a directory holding one (``load_gguf_model``), or a
            directory with ``config.json`` and ``*.safetensors`` (optionally sharded).
        dtype: weight dtype (tensors are cast on load; int4 layers take and return it).
        device: target device.
        weights: ``"fp32"`` (every weight dense in ``dtype``), ``"int4"`` (GGUF 4/8-bit blocks
            as int4 layers, CPU only) or ``"auto"`` (int4 when ``resolve_weights`` finds a GGUF
            with Q4 tensors and the device is a CPU).
        gguf_file: the GGUF the model directory was converted from (default: ``find_gguf``).
        prompt_weights: with int4 layers, how prompt tokens are read: ``"bf16"`` (through a
            dense bf16 copy of the same weights, ``quant.RowRoute``; +2 bytes per weight; its
            GEMM's low bits may depend on how many prompt rows a step reads, so greedy outputs
            may change with chunking and prefix caching), ``"int4"``, or ``"auto"`` (int4,
            which gives every row the same bits at any row count).
        block_terms: int8 terms per activation of the GGUF block layers, 1 or 2 (default
            ``kernel_policy.BLOCK_TERMS``).

    Returns:
        ``(model, config)``: the architecture's model (``registry``: ``LlamaForCausalLM``,
        ``Gemma3ForCausalLM``) in eval mode and the transformers config (for a GGUF: its
        ``gguf_config.GgufModelInfo``).

    Raises:
        ModelPathError: ``model_dir`` names no model.
        UnsupportedModelError: a GGUF of another architecture or tensor type.
        ValueError: a ``model_type`` the registry lacks (names it and the supported list) or RoPE.
        FileNotFoundError: no safetensors file in ``model_dir``.
        KeyError: a weight the architecture needs is missing from the checkpoint.
        ValueError: ``weights="int4"`` on a non-CPU device, or GGUF shapes that do not match.
    """
    from transformers import AutoConfig

    source = resolve_model_path(model_dir)
    if source.kind == "gguf":
        return load_gguf_model(source.path, dtype=dtype, device=device, weights=weights,
                               prompt_weights=prompt_weights, block_terms=block_terms)
    model_dir = source.path
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    spec = spec_from_hf_config(hf_config)
    kind, gguf_path = resolve_weights(weights, model_dir, device, gguf_file)
    # Placeholders on meta cost no memory, so the peak is one copy of the weights.
    model = build_model(spec, dtype=dtype, device="meta")
    if kind == "int4":
        # Before load_weights: int4 layers hold no parameters.
        from stencil.engine.models.gguf_file import GgufFile

        _install_int4(model, GgufFile(gguf_path), _prompt_route(prompt_weights), block_terms)
    with ExitStack() as stack:
        get = _open_checkpoint(model_dir, stack)
        load_weights(model, get, device=device)
    model.build_rope_tables(device, dtype)
    return model.eval(), hf_config


def check_model(path: Path | str) -> str:
    """Check, without loading weights, that ``path`` names a model Stencil serves; return a
    one-line description (``"gemma3 GGUF gemma-3-270m-q4_k_m.gguf"``).

    Raises:
        ModelPathError: the path names no model.
        UnsupportedModelError: an architecture, tensor type or setting Stencil lacks, or a
            file that is no readable GGUF; the message is one line naming it and what is supported.
    """
    from stencil.engine.models.gguf_config import UnsupportedModelError, read_gguf_info
    from stencil.engine.models.gguf_file import GgufFormatError

    source = resolve_model_path(path)
    if source.kind == "gguf":
        try:
            info = read_gguf_info(source.path)
        except KeyError as e:
            raise UnsupportedModelError(str(e).strip("'\"")) from None
        except GgufFormatError as e:
            raise UnsupportedModelError(str(e)) from None
        return f"{info.architecture} GGUF {source.path.name}"
    from transformers import AutoConfig

    try:
        spec_from_hf_config(AutoConfig.from_pretrained(str(source.path)))
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{source.path}: {e}".splitlines()[0]) from None
    return f"HF directory {source.path}"


def spec_from_hf_config(hf_config):
    """The spec of a transformers config, by its ``model_type``'s registry entry.

    Raises:
        ValueError: a ``model_type`` the registry lacks (names it and the supported ones), or
            settings the spec refuses.
    """
    return registry.for_hf_config(hf_config).spec_from_hf(hf_config)


def build_model(spec, *, dtype: torch.dtype, device: torch.device | str):
    """The model class of ``spec``'s registry entry, built with uninitialised parameters."""
    return registry.for_spec(spec).build(spec, dtype=dtype, device=device)


def load_gguf_model(path: Path | str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    weights: str = "auto", prompt_weights: str = "auto", block_terms: int | None = None):
    """Build our model from a GGUF file alone.

    With quantized weights (``"auto"`` on CPU, or ``"int4"``), every quantized matrix stays
    quantized, by the rule of ``kernel_policy.layer_kind``: Q4_0/Q4_1/Q8_0 projections as int4
    layers where the AVX512 int4 kernels build, everything else (and those types on any other
    CPU) as the file's own blocks (``gguf_layers.QuantLinear`` on ``csrc/gguf_gemm.c``); the
    embedding as a ``QuantEmbedding`` (rows dequantized on lookup), a tied LM head sharing its
    bytes. So the weights resident after load are about the file's size. Norms, float matrices
    and types no kernel reads (Q2_K, Q3_K) are decoded to ``dtype``.

    Args:
        path: the ``.gguf`` file.
        dtype, device, prompt_weights, block_terms: as ``load_model``.
        weights: ``"fp32"`` (every tensor decoded to ``dtype``: the reference), ``"int4"``
            (quantized layers as above; CPU only; the name is kept from when only 4-bit blocks
            were served) or ``"auto"`` (quantized on CPU when the file has quantized tensors).

    Returns:
        ``(model, info)``: the model in eval mode and its ``gguf_config.GgufModelInfo``.

    Raises:
        UnsupportedModelError: architecture, tensor type or settings Stencil lacks (one line).
        KeyError: a tensor or metadata key the architecture needs is missing.
        ValueError: bad ``weights``, or quantized weights on a device other than CPU.
    """
    from stencil.engine.models.gguf_config import read_gguf_info
    from stencil.engine.models.gguf_file import GgufFile
    from stencil.engine.models.gguf_weights import install, load_gguf_weights, quantized_modules
    from stencil.engine.models.kernel_policy import BLOCK_TYPES

    if weights not in ("auto", "fp32", "int4"):
        raise ValueError(f"weights must be auto, fp32 or int4, got {weights!r}")
    gguf = GgufFile(path)
    info = read_gguf_info(gguf)
    on_cpu = torch.device(device).type == "cpu"
    if weights == "int4" and not on_cpu:
        raise ValueError(f"int4 weights run on CPU only, not on {device}")
    quant = weights == "int4" or (weights == "auto" and on_cpu and gguf.count(BLOCK_TYPES) > 0)
    model = build_model(info.spec, dtype=dtype, device="meta")
    if quant:
        route = _prompt_route(prompt_weights)
        install(model, quantized_modules(gguf, info.spec, route=route, terms=block_terms))
        model.row_route = route
    load_gguf_weights(model, gguf, device=device)
    model.build_rope_tables(device, dtype)
    return model.eval(), info


def find_gguf(model_dir: Path | str) -> Path | None:
    """The GGUF file ``model_dir`` was converted from, or None: ``stencil.json``'s
    ``"gguf_file"`` (relative to ``model_dir`` or absolute) if that file exists, else the
    single ``*.gguf`` inside ``model_dir``."""
    model_dir = Path(model_dir)
    meta = model_dir / META_FILE
    if meta.is_file():
        named = json.loads(meta.read_text()).get("gguf_file")
        if named and (model_dir / named).is_file():
            return model_dir / named
    found = sorted(model_dir.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def resolve_weights(weights: str, model_dir: Path | str, device: torch.device | str,
                    gguf_file: Path | str | None = None) -> tuple[str, Path | None]:
    """Decide ``"fp32"`` or ``"int4"`` and the GGUF to read.

    ``"auto"`` is int4 on CPU when the GGUF exists and holds Q4_0/Q4_1 tensors (measured
    faster than fp32 at 1-32 concurrent sequences: ``stencil bench weights``), else fp32.

    Raises:
        ValueError: unknown ``weights``, or ``"int4"`` on a device other than CPU (torch's int4
            kernel used here is CPU-only).
        FileNotFoundError: ``"int4"`` without a GGUF.
    """
    if weights not in ("auto", "fp32", "int4"):
        raise ValueError(f"weights must be auto, fp32 or int4, got {weights!r}")
    if weights == "fp32":
        return "fp32", None
    on_cpu = torch.device(device).type == "cpu"
    path = Path(gguf_file) if gguf_file is not None else find_gguf(model_dir)
    if weights == "int4":
        if not on_cpu:
            raise ValueError(f"int4 weights run on CPU only, not on {device}")
        if path is None or not path.is_file():
            raise FileNotFoundError(f"int4 weights need the model's GGUF file; none found for {model_dir} "
                                    f"(pass gguf_file= or name it in {META_FILE})")
        return "int4", path
    if not on_cpu or path is None or not path.is_file():
        return "fp32", None
    from stencil.engine.models.gguf_file import GgufFile

    return ("int4", path) if GgufFile(path).count(_Q4) else ("fp32", None)


def _prompt_route(prompt_weights: str):
    from stencil.engine.models.quant import RowRoute

    if prompt_weights not in ("auto", "bf16", "int4"):
        raise ValueError(f"prompt_weights must be auto, bf16 or int4, got {prompt_weights!r}")
    # "auto" reads prompts through int4 (the int8-activation VNNI kernel where it runs: faster than
    # oneDNN's bf16 GEMM, 256 rows of 576 -> 3072: 4.1 vs 6.8 ms on 2 cores, `bench cpu_kernels`).
    # The dense bf16 copy is only taken on request: oneDNN picks its bf16 kernel by the number of
    # rows (on an AMX Xeon, 33 rows or more of 576 -> 3072 take another kernel than 32 or fewer,
    # with other low bits), so a prompt read in chunks, or partly from the prefix cache, can get
    # other bits than read whole, and a greedy output can change with the cache.
    return RowRoute() if prompt_weights == "bf16" else None


def _install_int4(model: LlamaForCausalLM, gguf, route=None, terms: int | None = None) -> None:
    """Replace the projections and the LM head whose GGUF tensors are quantized by the modules
    ``kernel_policy.layer_kind`` picks (int4 layers where the AVX512 int4 kernels build, else
    the file's blocks on ``csrc/gguf_gemm.c``); with a ``RowRoute``, int4 layer projections read
    prompt rows through a dense bf16 copy. ``gguf``: a ``gguf_file.GgufFile``. The embedding
    stays the HF directory's.

    One LM-head kernel for every row count: a dense bf16 copy is faster past ~4 rows, but
    switching kernels by row count changes a request's logits with the batch around it (up to
    0.08 here), and greedy outputs must not depend on batching or speculation."""
    from stencil.engine.models.gguf_weights import install, quantized_modules

    install(model, quantized_modules(gguf, model.spec, embedding=False, route=route, terms=terms))
    model.row_route = route


def load_weights(model: LlamaForCausalLM, get: Callable[[str], torch.Tensor], *,
                 device: torch.device | str | None = None) -> None:
    """Replace every parameter of ``model`` with HF-named tensors returned by ``get(name)``,
    cast to the parameter's dtype and moved to ``device`` (default: where the parameter is).

    Works for any source of HF names: a safetensors checkpoint, or
    ``transformers_model.state_dict().__getitem__``.

    Raises:
        KeyError: ``get`` lacks a needed tensor.
        ValueError: a tensor's shape does not match the architecture.
    """
    spec = model.spec
    arch = registry.for_spec(spec)
    target = torch.device(device) if device is not None else None
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        tensor = arch.hf_tensor(name, get)
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        new = nn.Parameter(tensor.to(device=target or param.device, dtype=param.dtype),
                           requires_grad=False)
        setattr(model.get_submodule(module_name), attr, new)
    if spec.tie_word_embeddings:
        model.tie_weights()


def _open_checkpoint(model_dir: Path, stack: ExitStack) -> Callable[[str], torch.Tensor]:
    """A ``get(name) -> tensor`` over every safetensors shard of ``model_dir``."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    where = {}
    for file in files:
        handle = stack.enter_context(safe_open(str(model_dir / file), framework="pt"))
        for key in handle.keys():
            where[key] = handle

    def get(key: str) -> torch.Tensor:
        handle = where.get(key)
        if handle is None:
            raise KeyError(f"{key} not found in the checkpoint at {model_dir}")
        return handle.get_tensor(key)

    return get
