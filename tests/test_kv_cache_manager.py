"""Prefix-cache keys when prompt and output tokens are computed by different weights."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams


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
    assert blocks == first.block_ids[:hit_tokens // 4]
    # A request with the very same prompt still shares the mixed block's prompt-only prefix.
    third = Request("c", list(range(10)) + [70, 71], SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.get_computed_blocks(third)[1] == 8
