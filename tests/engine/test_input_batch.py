"""``build_step_inputs`` (numpy over the whole batch) against a per-token Python reference."""

from __future__ import annotations

import random

import torch

from stencil.engine.input_batch import build_step_inputs
from stencil.engine.request import Request, SamplingParams
from stencil.engine.scheduler import ScheduledRequest, SchedulerOutput

BS = 16


def reference(out: SchedulerOutput) -> dict:
    """The layout token by token: what every field of ``StepInputs`` must hold."""
    ids, pos, slots, qsl, seq_lens, logits, prompt = [], [], [], [0], [], [], []
    width = max([len(sr.request.block_ids) for sr in out.scheduled] + [1])
    table = []
    for sr in out.scheduled:
        req = sr.request
        end = sr.start + sr.num_new_tokens
        for p in range(sr.start, end):
            ids.append(req.token_at(p))
            pos.append(p)
            slots.append(req.block_ids[p // BS] * BS + p % BS)
            prompt.append(p < req.num_prompt_tokens)
        qsl.append(qsl[-1] + sr.num_new_tokens)
        seq_lens.append(end)
        logits.extend(range(qsl[-1] - sr.num_logits, qsl[-1]))
        table.append(req.block_ids + [0] * (width - len(req.block_ids)))
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "query_start_loc": qsl,
            "seq_lens": seq_lens, "logits_indices": logits, "prompt_mask": prompt, "block_tables": table}


def random_schedule(rng: random.Random, n: int) -> SchedulerOutput:
    """Requests mid-prefill, decoding, with drafts, re-reading output after preemption."""
    out = SchedulerOutput()
    for i in range(n):
        r = Request(f"r{i}", [rng.randint(0, 99) for _ in range(rng.randint(1, 60))], SamplingParams(), 2)
        r.append_output([rng.randint(0, 99) for _ in range(rng.randint(0, 30))])
        r.draft_token_ids = [rng.randint(0, 99) for _ in range(rng.randint(0, 3))]
        start = rng.randint(0, r.num_tokens - 1)
        end = rng.randint(start + 1, r.num_tokens + len(r.draft_token_ids))
        r.block_ids = rng.sample(range(1000), -(-end // BS) + rng.randint(0, 2))
        sample = end >= r.num_tokens
        out.scheduled.append(ScheduledRequest(r, start, end - start, end - r.num_tokens if sample else 0, sample))
    return out


def test_step_inputs_match_the_per_token_layout():
    rng = random.Random(0)
    for _ in range(200):
        out = random_schedule(rng, rng.randint(1, 12))
        inp = build_step_inputs(out, BS, torch.device("cpu"))
        ref = reference(out)
        for name in ("input_ids", "positions", "logits_indices", "prompt_mask"):
            assert getattr(inp, name).tolist() == ref[name], name
        m = inp.meta
        assert m.slot_mapping.dtype == torch.int64 and m.slot_mapping.tolist() == ref["slot_mapping"]
        assert m.block_tables.dtype == torch.int32 and m.block_tables.tolist() == ref["block_tables"]
        assert m.query_start_loc.dtype == m.seq_lens.dtype == torch.int32
        assert m.query_start_loc.tolist() == m.query_start_loc_cpu == ref["query_start_loc"]
        assert m.seq_lens.tolist() == m.seq_lens_cpu == ref["seq_lens"]
        assert m.max_seq_len == max(ref["seq_lens"])
        q = ref["query_start_loc"]
        assert m.max_query_len == max(b - a for a, b in zip(q, q[1:]))
        assert inp.input_ids.dtype == inp.positions.dtype == inp.logits_indices.dtype == torch.int64


def test_a_window_group_gets_its_own_tables_and_slots():
    """With a hybrid cache's window group, ``meta.window_block_tables`` / ``window_slot_mapping``
    lay out each request's ``window_block_ids`` as ``block_tables`` lays out ``block_ids``, and
    ``for_window`` hands them to the windowed layers."""
    rng = random.Random(1)
    for _ in range(50):
        out = random_schedule(rng, rng.randint(1, 8))
        for sr in out.scheduled:
            # null (0) entries before the new tokens, fresh ids from 1000 on for the rest
            ids = sr.request.block_ids
            dead = rng.randint(0, sr.start // BS)
            sr.request.window_block_ids = [0] * dead + [1000 + b for b in ids[dead:]]
        inp = build_step_inputs(out, BS, torch.device("cpu"), window_group=True)
        m, w = inp.meta, inp.meta.for_window()
        width = m.block_tables.shape[1]
        want = [sr.request.window_block_ids + [0] * (width - len(sr.request.window_block_ids))
                for sr in out.scheduled]
        assert w.block_tables.tolist() == m.window_block_tables.tolist() == want
        slots = [sr.request.window_block_ids[p // BS] * BS + p % BS
                 for sr in out.scheduled for p in range(sr.start, sr.start + sr.num_new_tokens)]
        assert w.slot_mapping.tolist() == slots and min(s // BS for s in slots) >= 1000
        assert w.seq_lens_cpu == m.seq_lens_cpu and w.window_block_tables is None
        assert build_step_inputs(out, BS, torch.device("cpu")).meta.window_block_tables is None
