"""Load a Llama-family model from an HF-format directory (config.json + safetensors).

The config is read with ``transformers.AutoConfig``; weights are read straight from the
safetensors files (every shard named by ``model.safetensors.index.json`` when present) and
mapped onto our fused parameters: ``q_proj``/``k_proj``/``v_proj`` rows are stacked into
``qkv_proj`` and ``gate_proj``/``up_proj`` into ``gate_up_proj``. Unfused tensors are used as
read (no copy when dtype and device already match).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import LlamaSpec

INDEX_FILE = "model.safetensors.index.json"


def load_model(model_dir: Path | str, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu"):
    """Build our model from ``model_dir`` and fill its weights.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors`` (optionally sharded).
        dtype: weight dtype (tensors are cast on load).
        device: target device.

    Returns:
        ``(model, hf_config)``: a ``LlamaForCausalLM`` in eval mode and the transformers config.

    Raises:
        ValueError: unsupported ``model_type`` (names it and the supported list) or RoPE.
        FileNotFoundError: no safetensors file in ``model_dir``.
        KeyError: a weight the architecture needs is missing from the checkpoint.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    spec = LlamaSpec.from_hf_config(hf_config)
    # Placeholders on meta cost no memory, so the peak is one copy of the weights.
    model = LlamaForCausalLM(spec, dtype=dtype, device="meta")
    with ExitStack() as stack:
        get = _open_checkpoint(model_dir, stack)
        load_weights(model, get, device=device)
    model.build_rope_tables(device, dtype)
    return model.eval(), hf_config


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
    target = torch.device(device) if device is not None else None
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        tensor = _hf_tensor(name, get)
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        new = nn.Parameter(tensor.to(device=target or param.device, dtype=param.dtype),
                           requires_grad=False)
        setattr(model.get_submodule(module_name), attr, new)
    if spec.tie_word_embeddings:
        model.tie_weights()


def _hf_tensor(name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The HF tensor(s) behind our parameter ``name``, fused where we fuse."""
    if name == "lm_head.weight":
        return get("lm_head.weight")
    if name in ("embed_tokens.weight", "norm.weight"):
        return get(f"model.{name}")
    _, index, rest = name.split(".", 2)  # "layers", "3", "attn.qkv_proj.weight"
    hf_layer = f"model.layers.{index}."
    if rest.startswith("attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        return torch.cat([get(f"{hf_layer}self_attn.{p}_proj.{kind}") for p in "qkv"])
    if rest.startswith("mlp.gate_up_proj."):
        kind = rest.rsplit(".", 1)[1]
        return torch.cat([get(f"{hf_layer}mlp.{p}_proj.{kind}") for p in ("gate", "up")])
    renamed = {
        "input_norm.weight": "input_layernorm.weight",
        "post_attn_norm.weight": "post_attention_layernorm.weight",
    }.get(rest)
    if renamed is None:
        renamed = rest.replace("attn.", "self_attn.", 1) if rest.startswith("attn.") else rest
    return get(hf_layer + renamed)


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
