"""Rotary position embedding tables from a transformers config's ``rope_parameters``.

Supported ``rope_type`` values:

* ``"default"`` — ``inv_freq[i] = theta ** (-2i / head_dim)`` (Su et al. 2021, arXiv 2104.09864);
* ``"linear"`` — position interpolation: every frequency divided by ``factor`` (Chen et al.
  2023, arXiv 2306.15595);
* ``"llama3"`` — Llama 3.1's frequency-dependent scaling: wavelengths shorter than
  ``original_max_position_embeddings / high_freq_factor`` are kept, those longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the band
  between is interpolated linearly in ``original_max / wavelength`` (Meta's llama-models
  reference, ``apply_scaling``; the same rule as transformers' ``_compute_llama3_parameters``).

Others (dynamic NTK, YaRN, LongRoPE, ...) raise ``ValueError``.

A GGUF converted from a Llama 3.1-style config carries the result of that scaling as a tensor
of per-frequency divisors (``rope_freqs.weight``, llama.cpp's ``freq_factors``: it rotates
dimension pair ``i`` by ``theta ** (-2i / d) / freq_factors[i]``); ``RopeSpec.freq_factors``
holds it, and ``inv_frequencies`` divides by it after any other rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """RoPE settings read from a config.

    Attributes:
        rope_type: one of ``SUPPORTED_ROPE_TYPES``.
        theta: base wavelength.
        factor: scaling factor ("linear", "llama3"); 1.0 otherwise.
        low_freq_factor, high_freq_factor, original_max_position_embeddings: "llama3" only.
        freq_factors: per-pair divisors of the inverse frequencies (a GGUF's ``rope_freqs``),
            ``head_dim // 2`` floats, or None.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None

    @classmethod
    def from_hf_config(cls, config) -> "RopeSpec":
        """Read ``config.rope_parameters`` (transformers 5; falls back to ``rope_theta`` /
        ``rope_scaling`` of older configs).

        Raises:
            ValueError: an unsupported ``rope_type`` or partial rotary embedding.
        """
        params = dict(getattr(config, "rope_parameters", None) or {})
        if not params:
            params = dict(getattr(config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls.from_parameters(params, getattr(config, "partial_rotary_factor", 1.0))

    @classmethod
    def from_parameters(cls, params: dict, partial_rotary_factor: float = 1.0) -> "RopeSpec":
        """Read one ``rope_parameters`` dict (``{"rope_type": ..., "rope_theta": ...}``; Gemma 3
        keeps one per layer type).

        Raises:
            ValueError: an unsupported ``rope_type`` or partial rotary embedding.
        """
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: "
                             f"{list(SUPPORTED_ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", partial_rotary_factor)
        if partial != 1.0:
            raise ValueError(f"partial rotary embedding (partial_rotary_factor={partial}) "
                             "is not supported")
        spec = cls(rope_type=rope_type, theta=float(params["rope_theta"]))
        if rope_type == "linear":
            spec = cls(rope_type=rope_type, theta=spec.theta, factor=float(params["factor"]))
        elif rope_type == "llama3":
            spec = cls(rope_type=rope_type, theta=spec.theta, factor=float(params["factor"]),
                       low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           params["original_max_position_embeddings"]))
        return spec


def inv_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 (radians per position)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (spec.theta ** exponents)
    if spec.freq_factors is not None:
        if len(spec.freq_factors) != head_dim // 2:
            raise ValueError(f"{len(spec.freq_factors)} rope freq_factors for head_dim {head_dim}")
        inv_freq = inv_freq / torch.tensor(spec.freq_factors, dtype=torch.float32)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        old = spec.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor)
        blended = (1 - smooth) * inv_freq / spec.factor + smooth * inv_freq
        scaled = torch.where(wavelen > old / spec.low_freq_factor, inv_freq / spec.factor, inv_freq)
        in_band = (wavelen >= old / spec.high_freq_factor) & (wavelen <= old / spec.low_freq_factor)
        return torch.where(in_band, blended, scaled)
    return inv_freq


def rope_cos_sin(spec: RopeSpec, head_dim: int, max_positions: int,
                 device: torch.device | str = "cpu", start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` tables, each fp32 ``[max_positions - start, head_dim // 2]``; row ``r``
    rotates position ``start + r``. Computed in fp32 like transformers (the angle is the one
    product ``position * inv_freq``), so tables agree with its bit for bit. On the ``meta``
    device the tables are shapes only (no arithmetic: torch's meta arange goes through its
    decompositions, which import ``torch._dynamo`` and with it Triton, ~70 MB of a CPU server's
    memory)."""
    if torch.device(device).type == "meta":
        shape = (max_positions - start, head_dim // 2)
        return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
    inv_freq = inv_frequencies(spec, head_dim).to(device)
    angles = torch.arange(start, max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


class RopeTable:
    """The cos/sin rows of one RoPE, looked up by position.

    On CPU the table covers the positions a step has asked for so far, grown in blocks of
    ``BLOCK`` positions (doubling, so a long sequence costs O(n) copies in all) and never
    beyond ``max_positions``: a server whose requests stay short holds a few MB where the whole
    range of a 32k-context model's two RoPEs (Gemma 3) is 67 MB. Every block is computed alone
    over the same aligned range whenever it is computed, so a position's row has the same bits
    whatever the table's size or history (the engine's outputs must not depend on what ran
    before). On other devices the whole table is built at once: looking up the largest
    position would wait for the device on every step.

    Args:
        spec, head_dim: the rotation (``rope_cos_sin``).
        max_positions: the model's position limit (``max_position_embeddings``).
        device, dtype: where and in what dtype rows are returned (HF casts its tables to the
            activations' dtype too).
    """

    BLOCK = 1024

    def __init__(self, spec: RopeSpec, head_dim: int, max_positions: int, device: torch.device | str,
                 dtype: torch.dtype):
        self.spec, self.head_dim, self.max_positions = spec, head_dim, max_positions
        self.device, self.dtype = torch.device(device), dtype
        self.grows = self.device.type == "cpu"
        self.cos = torch.empty((0, head_dim // 2), dtype=dtype, device=self.device)
        self.sin = torch.empty((0, head_dim // 2), dtype=dtype, device=self.device)
        self.ensure(min(self.BLOCK, max_positions) if self.grows else max_positions)

    def __len__(self) -> int:
        return self.cos.shape[0]

    def ensure(self, positions: int) -> None:
        """Make rows ``[0, positions)`` present (``positions`` clipped to ``max_positions``)."""
        have = len(self)
        positions = min(positions, self.max_positions)
        if self.device.type == "meta":  # shapes only until the loader builds the table
            return
        if positions <= have:
            return
        size = min(self.max_positions, max(2 * have, -(-positions // self.BLOCK) * self.BLOCK))
        cos, sin = [self.cos], [self.sin]
        for start in range(have, size, self.BLOCK):
            c, s = rope_cos_sin(self.spec, self.head_dim, min(start + self.BLOCK, self.max_positions),
                                self.device, start=start)
            cos.append(c.to(self.dtype))
            sin.append(s.to(self.dtype))
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def lookup(self, positions: torch.Tensor, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` rows ``[T, head_dim // 2]`` of ``positions`` (int64 ``[T]``); ``end``:
        their largest plus one when the caller knows it (a model with two tables reads it once).

        Raises:
            IndexError: a position at or past ``max_positions`` (torch's indexing error).
        """
        if self.grows and positions.numel():
            self.ensure(int(positions.max()) + 1 if end is None else end)
        return self.cos[positions], self.sin[positions]
