"""Turns a schedule into tensors, runs the model over the flat batch, masks and samples."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from stencil.engine.config import ACTIVATION_PRECISIONS, EngineConfig
from stencil.engine.input_batch import build_step_inputs
from stencil.engine.kv_cache_manager import blocks_for_bytes, kv_cache_groups
from stencil.engine.malloc import keep_step_buffers
from stencil.engine.sampler import Sampler
from stencil.engine.scheduler import SchedulerOutput
from stencil.engine.step_timing import StepTimer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_kv_cache_bytes(device: torch.device) -> int:
    """KV-cache size when none is configured (bytes).

    CPU: 20% of the memory available now, capped at 4 GiB (a CPU decode step is bound by the
    weights, not by how many sequences fit). CUDA: the caller sizes it from free device memory.
    """
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(0.2 * avail, 4 << 30))


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per sampled request (in schedule order): accepted drafts + one new token; logprobs if asked
    (and the top alternatives per token, see ``stencil.engine.sampler.SamplerOutput``)."""

    sampled: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


class ModelRunner:
    """Owns the model weights, the paged KV cache and the attention backend."""

    def __init__(self, config: EngineConfig):
        from stencil.engine.models.loader import load_model
        from stencil.kernels.registry import get_backend

        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model, self.hf_config = load_model(config.model, dtype=self.dtype, device=self.device,
                                                weights=config.weights,
                                                gguf_file=config.extra.get("gguf_file"),
                                                prompt_weights=config.prompt_weights,
                                                block_terms=ACTIVATION_PRECISIONS[config.activation_precision])
        self.backend = get_backend(config.attention_backend, self.device)
        keep_step_buffers()  # a step's logits (33.5 MB at 32 rows of 262k) from the heap, not mmap
        self.kv_dtype = _DTYPES[config.kv_cache_dtype]
        self.block_size = config.block_size
        self.vocab_size = self.model.vocab_size
        # KV cache groups: a model mixing full-attention and windowed layers gives its windowed
        # ones tensors of their own, sized for the blocks their windows hold (kv_cache_groups).
        windows = [self.model.spec.layer_window(i) for i in range(self.model.num_layers)]
        self.num_blocks = self._num_blocks(windows)
        self.kv_groups, layer_groups = kv_cache_groups(
            windows, self.num_blocks, block_size=self.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, hybrid=config.hybrid_kv_cache)
        self.kv_caches = []
        for g in layer_groups:
            shape = (self.kv_groups[g].pool_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
            self.kv_caches.append((torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                                   torch.zeros(shape, dtype=self.kv_dtype, device=self.device)))
        self.sampler = Sampler(config.seed)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache tensors hold, every group's."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block in every layer: what ``num_kv_blocks`` blocks cost without a window group."""
        m = self.model
        elem = torch.finfo(self.kv_dtype).bits // 8
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    @property
    def prompt_rows_routed(self) -> bool:
        """Whether prompt tokens take other weights than output tokens (``quant.RowRoute``):
        then a cached block's K/V also depend on where the prompt ended."""
        return getattr(self.model, "row_route", None) is not None

    def _num_blocks(self, windows: list[int | None]) -> int:
        """The full group's blocks: ``num_kv_blocks`` as given, else as many as the byte budget
        (``kv_cache_gib``, free CUDA memory times ``gpu_memory_utilization``, or
        ``default_kv_cache_bytes``) holds with every group's tensors counted
        (``kv_cache_manager.blocks_for_bytes``: a hybrid cache holds more tokens in the same bytes)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_gib is not None:
            total = int(cfg.kv_cache_gib * (1 << 30))
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            total = int(free * cfg.gpu_memory_utilization)
        else:
            total = default_kv_cache_bytes(self.device)
        return blocks_for_bytes(total, self.bytes_per_block // self.model.num_layers, windows,
                                block_size=self.block_size, max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens, hybrid=cfg.hybrid_kv_cache)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, bitmask: torch.Tensor | None,
                timer: StepTimer | None = None) -> ModelRunnerOutput:
        """Run one step.

        Args:
            out: the schedule (requests in batch order).
            bitmask: int32 ``[num_logits_rows, ceil(V / 32)]`` or None when no request is constrained.
            timer: marks the phases inputs, forward, logits and sample (``stencil.engine.step_timing``).
        """
        timer = timer or StepTimer()
        inp = build_step_inputs(out, self.block_size, self.device, window_group=len(self.kv_groups) > 1)
        timer.mark("inputs")
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, self.backend,
                            prompt_mask=inp.prompt_mask)
        if inp.logits_indices.numel() == 0:
            timer.mark("forward")
            return ModelRunnerOutput([], None)
        rows = hidden[inp.logits_indices]
        timer.mark("forward")  # on CUDA the kernels may still run: "logits" waits for both
        if bitmask is not None and hasattr(self.model.lm_head, "forward_columns"):
            logits = self.model.finish_logits(masked_logits(self.model.lm_head, rows, bitmask, self.vocab_size))
        else:
            logits = self.model.compute_logits(rows).float()
        _sync(logits)
        timer.mark("logits")
        if bitmask is not None:
            from stencil.engine.structured_output import apply_bitmask_

            apply_bitmask_(logits, bitmask.to(logits.device, non_blocking=True))
        sampled_reqs = [sr.request for sr in out.scheduled if sr.sample]
        drafts = [sr.request.draft_token_ids[:sr.num_drafts] for sr in out.scheduled if sr.sample]
        want_lp = any(r.params.logprobs or r.params.top_logprobs for r in sampled_reqs)
        tokens, lps, tops = self.sampler(logits.cpu(), sampled_reqs, drafts, want_logprobs=want_lp)
        timer.mark("sample")
        return ModelRunnerOutput(tokens, lps, tops)


def _sync(t: torch.Tensor) -> None:
    """Wait for ``t``'s device work (CUDA only), so a phase's time is its own; free on CPU."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


SPARSE_BLOCKS = 96  # rows allowing tokens in at most this many 64-token blocks: sparse LM head


def masked_logits(head, rows: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """LM head logits ``[R, vocab_size]`` (fp32) that are exact wherever ``bitmask`` allows a
    token and ``-inf`` in 64-token blocks it allows none.

    A row whose grammar allows tokens in at most ``SPARSE_BLOCKS`` blocks of ``COLUMN_BLOCK``
    tokens (a key being written, a digit, a closing quote) gets only those blocks
    (``Int4Linear.forward_columns``: one block 30 us, 16 blocks 0.15 ms, against 2.3 ms for the
    whole 49,152-token head of SmolLM2); the other rows go through the head together. The
    allowed tokens' logits are the same bits either way, so the choice (made from the row's own
    mask) never changes a sampled token.

    Args:
        head: an ``Int4Linear`` LM head.
        rows: hidden states ``[R, hidden_size]``.
        bitmask: int32 ``[R, ceil(vocab_size / 32)]``, bit ``t`` of a row set when token ``t``
            is allowed.
    """
    from stencil.engine.models.quant import COLUMN_BLOCK, block_columns

    n_rows = rows.shape[0]
    words_per_block = COLUMN_BLOCK // 32
    words = bitmask.cpu()
    pad = -words.shape[1] % words_per_block
    if pad:
        words = torch.cat([words, words.new_zeros(n_rows, pad)], dim=1)
    n_pad = head.padded_out_features
    if n_pad % COLUMN_BLOCK or words.shape[1] * 32 > n_pad:
        return head(rows).float()[:, :vocab_size]
    live = (words.view(n_rows, -1, words_per_block) != 0).any(-1)  # [R, blocks]
    counts = live.sum(1)
    sparse = (counts > 0) & (counts <= SPARSE_BLOCKS)
    if not bool(sparse.any()):
        return head(rows).float()
    # (uninitialized: the dense rows are written whole, only the sparse rows start at -inf; a
    # full -inf fill of 32 rows of Gemma 3's 262,144 tokens cost 9-14 ms a step)
    logits = torch.empty((n_rows, vocab_size), dtype=torch.float32, device=rows.device)
    dense = (~sparse).nonzero().flatten()
    if dense.numel():
        logits[dense] = head(rows[dense]).float()[:, :vocab_size]
    for r in sparse.nonzero().flatten().tolist():
        blocks = live[r].nonzero().flatten()
        cols = block_columns(blocks)
        keep = cols < vocab_size
        logits[r].fill_(float("-inf"))
        logits[r, cols[keep]] = head.forward_columns(rows[r:r + 1], blocks)[0, keep]
    return logits
