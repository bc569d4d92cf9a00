"""Flat, unpadded model inputs for one scheduled step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import SchedulerOutput
from kernels.base import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    """Tensors of one step.

    Attributes:
        input_ids: int64 ``[T]``; every scheduled request's new tokens, back to back.
        positions: int64 ``[T]``; each token's position in its sequence.
        meta: where each token's K/V go and which K/V each query reads.
        logits_indices: int64 ``[R]``; rows of the hidden states whose logits are sampled (the
            last ``num_drafts + 1`` tokens of each sampled request).
        prompt_mask: bool ``[T]``; tokens at a position inside their request's prompt (a
            token the model produced stays an output token when re-read after preemption).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    prompt_mask: torch.Tensor


def build_step_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    """Lay out the scheduled tokens as one flat batch (slot = block_id * block_size + offset)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    logits_idx: list[int] = []
    prompt_lens: list[int] = []
    bs = block_size
    max_blocks = 1
    for sr in out.scheduled:
        req = sr.request
        end = sr.start + sr.num_new_tokens
        input_ids.extend(req.tokens_range(sr.start, end))
        positions.extend(range(sr.start, end))
        prompt_lens.extend([req.num_prompt_tokens] * sr.num_new_tokens)
        blocks = req.block_ids
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(sr.start, end))
        qsl.append(qsl[-1] + sr.num_new_tokens)
        seq_lens.append(end)
        max_blocks = max(max_blocks, len(blocks))
        if sr.sample:
            logits_idx.extend(range(qsl[-1] - sr.num_logits, qsl[-1]))
    table = torch.zeros((len(out.scheduled), max_blocks), dtype=torch.int32)
    for i, sr in enumerate(out.scheduled):
        ids = sr.request.block_ids
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=_to(torch.tensor(qsl, dtype=torch.int32), device),
        seq_lens=_to(torch.tensor(seq_lens, dtype=torch.int32), device),
        block_tables=_to(table, device),
        slot_mapping=_to(torch.tensor(slots, dtype=torch.int64), device),
        max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(seq_lens))),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    pos = torch.tensor(positions, dtype=torch.long)
    return StepInputs(
        input_ids=_to(torch.tensor(input_ids, dtype=torch.long), device),
        positions=_to(pos, device),
        meta=meta,
        logits_indices=_to(torch.tensor(logits_idx, dtype=torch.long), device),
        prompt_mask=_to(pos < torch.tensor(prompt_lens, dtype=torch.long), device),
    )


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor → ``device``: through pinned memory without a sync on CUDA, as is on CPU."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
