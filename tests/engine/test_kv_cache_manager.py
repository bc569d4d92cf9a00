"""Prefix-cache keys when prompt and output tokens are computed by different weights."""

from __future__ import annotations

import pytest

from stencil.engine.kv_cache_manager import KVCacheManager
from stencil.engine.request import Request, SamplingParams


def _finish_turn(kv: KVCacheManager, req: Request, outputs: list[int]) -> None:
    assert kv.allocate_slots(req, req.num_tokens + len(outputs))
    req.append_output(outputs)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


@pytest.mark.parametrize("boundary", [False, True])
def test_block_holding_output_tokens_is_reused_only_when_computed_alike(boundary):
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_prompt_boundary=boundary)
    first = Request("a", list(range(10)), SamplingParams(max_tokens=4), eos_token_id=None)
    _finish_turn(kv, first, [50, 51, 52])  # 13 tokens: blocks 0-1 prompt, 2 mixed (2 + 2)
    # The next turn's prompt repeats the first turn, outputs included.
    second = Request("b", list(range(10)) + [50, 51, 52, 60, 61], SamplingParams(max_tokens=4),
                     eos_token_id=None)
    blocks, hit_tokens = kv.get_computed_blocks(second)
    # Block 2 holds prompt tokens 8-9 and output tokens 50-51 for "a", but four prompt tokens for
    # "b": with routed weights its K/V differ, so only the two prompt-only blocks are shared.
    assert hit_tokens == (8 if boundary else 12)
    assert blocks == [first.block_ids[:hit_tokens // 4]]
    # A request with the very same prompt still shares the mixed block's prompt-only prefix.
    third = Request("c", list(range(10)) + [70, 71], SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.get_computed_blocks(third)[1] == 8


def test_blocks_computed_after_a_prefix_hit_are_registered_for_the_next_request():
    """A request admitted on a prefix hit registers the full blocks it then computes: the same
    conversation one turn longer hits all of them (it hit only the first turn's blocks while the
    new ones were counted as registered at allocation)."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    system = list(range(8))  # two blocks every conversation shares
    first = Request("a", system + [20, 21], SamplingParams(max_tokens=1), eos_token_id=None)
    _finish_turn(kv, first, [])
    turn = system + [30, 31, 32, 33, 34, 35, 36, 37, 38]  # two more full blocks, one partial
    for i, expected_hit in enumerate((8, 16)):
        req = Request(f"t{i}", turn, SamplingParams(max_tokens=1), eos_token_id=None)
        blocks, hit = kv.get_computed_blocks(req)
        assert hit == expected_hit  # the second time: the blocks the first one computed
        req.num_computed_tokens = hit
        assert kv.allocate_slots(req, req.num_tokens - hit, blocks)
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
        kv.free(req)


# -- stable block hashes ------------------------------------------------------------------------

import hashlib  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from stencil.engine.kv_cache_manager import hash_block, prompt_block_hashes  # noqa: E402

_CHAIN_SCRIPT = ("import sys; from stencil.engine.kv_cache_manager import prompt_block_hashes; "
                 "print(prompt_block_hashes(list(range(100, 164)), 16))")


def _digest(parent: int | None, tokens: list[int], extra: tuple | None = None) -> int:
    """The documented canonical bytes, written out independently of ``hash_block``."""
    data = (b"stencil\x00\x00" if parent is None else struct.pack("<Q", parent))
    data += b"".join(struct.pack("<I", t) for t in tokens)
    if extra is not None:
        data += repr(extra).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_hash_block_is_blake2b_over_canonical_bytes():
    first = hash_block(None, (1, 2, 3))
    assert first == _digest(None, [1, 2, 3])
    assert hash_block(first, [4, 5], ("prompt_tokens", 1)) == _digest(first, [4, 5], ("prompt_tokens", 1))
    assert hash_block(first, [4, 5]) != hash_block(first, [4, 5], ("prompt_tokens", 1))
    assert hash_block(None, [4, 5]) != hash_block(first, [4, 5])  # the parent is part of the key


def test_block_hash_chain_is_the_same_in_every_process():
    """Replicas and the router run in other processes, each with its own PYTHONHASHSEED."""
    chains = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _CHAIN_SCRIPT], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
                             cwd=str(Path(__file__).resolve().parents[2]))
        chains.add(out.stdout.strip())
    assert chains == {str(prompt_block_hashes(list(range(100, 164)), 16))}


@pytest.mark.parametrize("boundary", [False, True])
def test_prompt_block_hashes_equal_the_engine_chain(boundary):
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_prompt_boundary=boundary)
    prompt = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0]  # two full blocks, then 3 tokens
    req = Request("a", prompt, SamplingParams(max_tokens=4), eos_token_id=None)
    _finish_turn(kv, req, [11, 12])  # 13 tokens: blocks 0-1 prompt-only, block 2 mixed
    assert len(kv.cached_block_hashes()) == 3
    assert kv.cached_block_hashes()[:2] == prompt_block_hashes(prompt, 4)
    assert prompt_block_hashes(prompt, 4, max_blocks=1) == prompt_block_hashes(prompt, 4)[:1]
    assert kv.cached_block_hashes(limit=1) == kv.cached_block_hashes()[:1]


def test_colliding_hashes_are_never_a_hit(monkeypatch):
    """Every block gets the same key: a lookup must still compare the stored token ids."""
    from stencil.engine import kv_cache_manager

    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, tokens, extra=None: 42)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), eos_token_id=None)
    _finish_turn(kv, first, [])
    other = Request("b", [9, 9, 9, 9, 5], SamplingParams(max_tokens=1), eos_token_id=None)
    assert kv.get_computed_blocks(other) == ([[]], 0)
    same = Request("c", [1, 2, 3, 4, 6], SamplingParams(max_tokens=1), eos_token_id=None)
    assert kv.get_computed_blocks(same) == ([first.block_ids[:1]], 4)


# -- KV cache groups: a sliding-window group beside the full one ---------------------------------

from stencil.engine.block_pool import NULL_BLOCK  # noqa: E402
from stencil.engine.kv_cache_manager import KVCacheGroup, kv_cache_groups  # noqa: E402


def test_kv_cache_groups_split_only_a_model_that_mixes_full_and_windowed_layers():
    kw = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    assert kv_cache_groups([None] * 3, 100, **kw) == ([KVCacheGroup(100)], [0, 0, 0])  # Llama, SmolLM2
    gemma = [512] * 5 + [None]
    assert kv_cache_groups(gemma, 100, hybrid=False, **kw) == ([KVCacheGroup(100)], [0] * 6)
    assert kv_cache_groups([32, 32], 100, **kw) == ([KVCacheGroup(100, 32)], [0, 0])  # every layer windowed
    # 4 requests x (a 512-token window's 32 blocks + 2) + a step's 64 tokens (4 blocks): 140 blocks
    assert kv_cache_groups(gemma, 1000, **kw) == ([KVCacheGroup(1000), KVCacheGroup(140, 512)], [1] * 5 + [0])
    assert kv_cache_groups(gemma, 100, **kw)[0][1] == KVCacheGroup(100, 512)  # never more than the full group
    assert KVCacheGroup(100, 512).pool_blocks == 101 and KVCacheGroup(100).pool_blocks == 100  # the null block


def _hybrid(window: int = 6, blocks: int = 32, window_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(blocks, 4, groups=[KVCacheGroup(blocks), KVCacheGroup(window_blocks, window)])


def test_window_blocks_are_released_once_no_later_query_sees_them():
    kv = _hybrid(window=6)
    req = Request("a", list(range(30)), SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.allocate_slots(req, 30)
    assert len(req.block_ids) == len(req.window_block_ids) == 8 and NULL_BLOCK not in req.window_block_ids
    req.num_computed_tokens = 30
    kv.cache_full_blocks(req)
    # The next query sits at position 30 and sees keys 25..30: blocks 0-5 (keys 0..23) are dead.
    assert kv.first_live_block(30, 1) == 6 and kv.first_live_block(30, 0) == 0
    assert req.window_block_ids[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in req.window_block_ids[6:]
    assert kv.group_blocks() == [(32, 24), (32, 30)]
    kv.check_invariants([req])
    kv.free(req)
    assert kv.group_blocks() == [(32, 32), (32, 32)] and req.window_block_ids == []
    kv.check_invariants([])


def test_a_prefix_hit_needs_the_windows_blocks_and_is_the_longest_both_groups_serve():
    kv = _hybrid(window=6)
    tokens = list(range(100, 130))
    first = Request("a", tokens, SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.cache_full_blocks(first)  # window blocks 0-5 released early, hashes kept in the free queue
    kv.free(first)
    second = Request("b", tokens + [7], SamplingParams(max_tokens=4), eos_token_id=None)
    (full, window), hit = kv.get_computed_blocks(second)
    # 7 full blocks (one token is left to compute); a query at 28 sees keys 23..28: blocks 5-6.
    assert hit == 28 and full == first_full(kv, tokens, 7)
    assert window[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in window[5:]
    # Evict the window block of keys 20..23 (allocation takes the least recently freed first):
    # a hit at 28 or 24 needs it, one at 20 (keys 15..20: blocks 3-4) does not.
    pool = kv.pools[1]
    victim = window[5]
    taken = []
    while victim in pool.free_queue:
        taken += pool.allocate(1)
    pool.free(taken)
    (full, window), hit = kv.get_computed_blocks(second)
    assert hit == 20 and len(full) == len(window) == 5 and window[:3] == [NULL_BLOCK] * 3
    second.num_computed_tokens = hit
    assert kv.allocate_slots(second, 31 - hit, [full, window])
    kv.check_invariants([second])
    assert second.block_ids[:5] == full and second.window_block_ids[:5] == window
    kv.free(second)
    kv.check_invariants([])


def first_full(kv: KVCacheManager, tokens: list[int], n: int) -> list[int]:
    """Group 0's cached block ids of the first ``n`` blocks of ``tokens``."""
    hashes = prompt_block_hashes(tokens, kv.block_size, n)
    return [kv.pool.lookup(h, tuple(tokens[i * 4:(i + 1) * 4])) for i, h in enumerate(hashes)]


def test_allocation_fails_whole_when_the_window_group_is_short():
    kv = _hybrid(window=6, blocks=32, window_blocks=3)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.allocate_slots(a, 8)  # 2 blocks in each group
    b = Request("b", list(range(50, 58)), SamplingParams(max_tokens=4), eos_token_id=None)
    assert not kv.allocate_slots(b, 8)  # group 0 has room, the window group has one block
    assert b.block_ids == b.window_block_ids == [] and kv.group_blocks() == [(32, 30), (3, 1)]
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)  # a query at 8 sees keys 3..8: block 0 (keys 0..3) stays
    assert kv.group_blocks()[1] == (3, 1)
    assert kv.allocate_slots(a, 4) and kv.group_blocks()[1] == (3, 0)
    assert not kv.allocate_slots(b, 4)
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)  # the next query at 12 sees keys 7..12: block 0 is released
    assert a.window_block_ids[0] == NULL_BLOCK and kv.group_blocks() == [(32, 29), (3, 1)]
    assert kv.allocate_slots(b, 4)
    kv.check_invariants([a, b])


def test_a_byte_budget_buys_a_hybrid_cache_more_tokens_and_fits():
    """``blocks_for_bytes``: every group's tensors fit the budget, and the next block would not."""
    from stencil.engine.kv_cache_manager import blocks_for_bytes, kv_cache_groups, window_pool_need

    layer = 2 * 16 * 1 * 256 * 2  # one block of one Gemma-3-270M-shaped layer: K and V, fp16
    windows = [512, 512, 512, 512, 512, None] * 3
    kw = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=2048)

    def cost(n: int) -> int:
        groups, which = kv_cache_groups(windows, n, **kw)
        return sum(groups[g].pool_blocks for g in which) * layer

    for budget in (10 * 2**20, 64 * 2**20, 300 * 2**20, 4 * 2**30):
        n = blocks_for_bytes(budget, layer, windows, **kw)
        assert cost(n) <= budget < cost(n + 1)
        # never fewer tokens than keeping every position, but for the window pool's null block
        assert n >= budget // (len(windows) * layer) - 1
    need = window_pool_need(512, **kw)
    big = blocks_for_bytes(4 * 2**30, layer, windows, **kw)
    assert big > need and big > 5 * (4 * 2**30 // (len(windows) * layer))  # 3 of 18 layers keep everything
    # no window group (switched off, or no windowed layer): every layer holds every block
    assert blocks_for_bytes(4 * 2**30, layer, windows, hybrid=False, **kw) == 4 * 2**30 // (18 * layer)
    assert blocks_for_bytes(4 * 2**30, layer, [None] * 18, **kw) == 4 * 2**30 // (18 * layer)
    assert blocks_for_bytes(1, layer, windows, **kw) == 1
