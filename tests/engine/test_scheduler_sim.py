"""Randomized simulation of the scheduler + KV cache with a fake model that reads its K/V back.

The fake model writes each scheduled token id into its cache slot and, for every logits row,
reads the whole sequence back through the block table. The next token is a hash of what it read,
so a wrong block table, a bad prefix-cache hit or a rejected draft's stale K/V changes the
output, which is compared with the same request computed alone. After every step the named
invariants of the block pools are checked.

With a hybrid cache (``stencil.engine.kv_cache_manager``: a sliding-window group beside the full one) the
fake model also writes every token into the window group's slots and checks, for every new row,
the keys its window sees through the window group's table; the window group's blocks must stay
bounded by the window while the full group's grow.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from stencil.engine.config import EngineConfig
from stencil.engine.input_batch import build_step_inputs
from stencil.engine.kv_cache_manager import KVCacheGroup, KVCacheManager, kv_cache_groups
from stencil.engine.request import Request, RequestStatus, SamplingParams
from stencil.engine.scheduler import Scheduler

EOS = 2
VOCAB = 50


def next_token(seq: list[int] | np.ndarray) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    h = 0
    for t in seq[-6:]:
        h = (h * 1_000_003 + int(t) + 7) % 2_147_483_647
    h = (h + len(seq) * 31) % 2_147_483_647
    return EOS if h % 97 == 0 else 3 + h % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    seq = list(prompt)
    out = []
    while len(out) < max_tokens:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if t == EOS:
            return out, "stop"
    return out, "length"


class FakeRunner:
    def __init__(self, groups: list[KVCacheGroup], block_size: int, rng: random.Random):
        self.bs = block_size
        self.kv = np.full(groups[0].pool_blocks * block_size, -1, dtype=np.int64)
        self.window = groups[1].window if len(groups) > 1 else None
        self.wkv = np.full(groups[-1].pool_blocks * block_size, -1, dtype=np.int64)
        self.rng = rng

    def execute(self, out) -> list[list[int]]:
        import torch

        inp = build_step_inputs(out, self.bs, torch.device("cpu"), window_group=self.window is not None)
        self.kv[inp.meta.slot_mapping.numpy()] = inp.input_ids.numpy()
        if self.window is not None:
            w = inp.meta.for_window()
            assert (w.slot_mapping.numpy() >= self.bs).all(), "a new token written into the null block"
            self.wkv[w.slot_mapping.numpy()] = inp.input_ids.numpy()
        sampled = []
        for i, sr in enumerate(out.scheduled):
            req = sr.request
            end = sr.start + sr.num_new_tokens
            if self.window is not None:  # every key the step's rows see in the window group
                blocks = w.block_tables[i].tolist()
                first = max(0, sr.start - self.window + 1)
                seen = self.wkv[[blocks[p // self.bs] * self.bs + p % self.bs for p in range(first, end)]]
                assert seen.tolist() == req.tokens_range(first, end), f"window KV content wrong for {req}"
            if not sr.sample:
                continue
            blocks = inp.meta.block_tables[i].tolist()
            slots = [blocks[p // self.bs] * self.bs + p % self.bs for p in range(end)]
            seen = self.kv[slots]  # the sequence as the cache holds it
            assert seen.tolist() == req.tokens_range(0, end), f"KV content wrong for {req}"
            drafts = req.draft_token_ids[:sr.num_drafts]
            base = end - sr.num_drafts  # tokens before the first draft
            tokens = []
            for j in range(sr.num_drafts + 1):
                t = next_token(seen[:base + j])
                tokens.append(t)
                if j >= len(drafts) or drafts[j] != t:
                    break
            sampled.append(tokens)
        return sampled


def check_invariants(sched: Scheduler, kv: KVCacheManager) -> None:
    owners = Counter(b for r in sched.running for b in r.block_ids)
    for r in sched.waiting:
        owners.update(r.block_ids)
    kv.pool.check_invariants(dict(owners))
    kv.check_invariants(sched.running + list(sched.waiting))
    for r in sched.running:
        assert len(r.block_ids) * kv.block_size >= r.num_computed_tokens, r
        assert r.status == RequestStatus.RUNNING
    assert not set(map(id, sched.running)) & set(map(id, sched.waiting))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_simulation_invariants_and_outputs(seed):
    simulate(seed, [KVCacheGroup(48)])  # small: forces preemption


@pytest.mark.parametrize("seed,window,window_blocks", [(0, 20, None), (1, 20, None), (2, 40, 14), (3, 7, 9)])
def test_random_simulation_with_a_window_group(seed, window, window_blocks):
    """A hybrid cache: the window group sized by ``kv_cache_groups`` (as many blocks as the full
    group here: 12 running requests), or smaller, so that it is the one that runs out and
    preempts. Outputs, prefix hits and both pools' invariants hold all the same."""
    groups, layers = kv_cache_groups([window, None], 48, block_size=16, max_num_seqs=12, max_num_batched_tokens=96)
    assert layers == [1, 0] and groups[0] == KVCacheGroup(48) and groups[1].window == window
    if window_blocks is not None:
        groups[1] = KVCacheGroup(window_blocks, window)
    held = simulate(seed, groups)
    # The window group held at most a window and a step's tokens per request; the full group
    # held whole sequences.
    assert held[1] <= 12 * (-(-(window - 1) // 16) + 2) + 6
    assert held[0] > held[1] if window_blocks is None else held[1] <= window_blocks


def simulate(seed: int, groups: list[KVCacheGroup]) -> list[int]:
    """Run 700 random requests; return the most blocks each group's pool held at once."""
    rng = random.Random(seed)
    bs = 16
    num_blocks = groups[0].num_blocks
    cfg = EngineConfig(model="unused", max_num_seqs=12, max_num_batched_tokens=96, max_prefill_chunk=40)
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, groups=groups)
    sched = Scheduler(cfg, kv, max_model_len=400)
    sched.enable_forced_tokens = False
    runner = FakeRunner(groups, bs, rng)
    most_held = [0] * len(groups)
    prefixes = [[rng.randrange(3, 3 + VOCAB) for _ in range(n)] for n in (0, 16, 33, 64, 80)]
    n_requests = 700
    expected: dict[str, tuple[list[int], str]] = {}
    got: dict[str, list[int]] = {}
    status: dict[str, RequestStatus] = {}
    reqs: dict[str, Request] = {}
    added = 0
    steps = 0
    aborted = set()
    while added < n_requests or sched.num_unfinished:
        for _ in range(rng.randrange(0, 4)):
            if added >= n_requests:
                break
            prompt = rng.choice(prefixes) + [rng.randrange(3, 3 + VOCAB) for _ in range(rng.randrange(1, 60))]
            max_tokens = rng.randrange(1, 40)
            rid = f"r{added}"
            req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), EOS)
            sched.add(req)
            reqs[rid] = req
            expected[rid] = reference_output(prompt, max_tokens)
            got[rid] = []
            added += 1
        # Random drafts: some right (copied from the reference), some wrong.
        for r in sched.running:
            if r.num_computed_tokens >= r.num_tokens - 1 and rng.random() < 0.5:
                ref = expected[r.request_id][0]
                k = rng.randrange(1, 6)
                drafts = ref[r.num_output_tokens + 1:r.num_output_tokens + 1 + k]
                if drafts and rng.random() < 0.4:
                    drafts[rng.randrange(len(drafts))] = rng.randrange(3, 3 + VOCAB)
                r.draft_token_ids = drafts[:max(0, r.params.max_tokens - r.num_output_tokens - 1)]
        if sched.running and rng.random() < 0.03:
            victim = rng.choice(sched.running + list(sched.waiting))
            aborted.add(victim.request_id)
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if out.scheduled:
            sampled = runner.execute(out)
            for req, new in sched.update(out, sampled):
                got[req.request_id].extend(new)
        for req in sched.drain_finished():
            status[req.request_id] = req.status
        check_invariants(sched, kv)
        most_held = [max(m, total - free) for m, (total, free) in zip(most_held, kv.group_blocks())]
        steps += 1
        assert steps < 20000, "simulation does not terminate"
    assert kv.num_free_blocks == num_blocks
    assert all(free == total for total, free in kv.group_blocks())
    assert sched.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert kv.prefix_hits > 0
    assert len(status) == n_requests
    for rid, (ref, reason) in expected.items():
        if rid in aborted:
            assert status[rid] == RequestStatus.FINISHED_ABORTED
            assert got[rid] == ref[:len(got[rid])]
            continue
        assert got[rid] == ref, rid
        assert reqs[rid].finish_reason == reason
    return most_held
