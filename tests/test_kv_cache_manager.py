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
    assert blocks == [first.block_ids[:hit_tokens // 4]]
    # A request with the very same prompt still shares the mixed block's prompt-only prefix.
    third = Request("c", list(range(10)) + [70, 71], SamplingParams(max_tokens=4), eos_token_id=None)
    assert kv.get_computed_blocks(third)[1] == 8


# -- stable block hashes ------------------------------------------------------------------------

import hashlib  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from engine.kv_cache_manager import hash_block, prompt_block_hashes  # noqa: E402

_CHAIN_SCRIPT = ("import sys; from engine.kv_cache_manager import prompt_block_hashes; "
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
                             cwd=str(Path(__file__).resolve().parents[1]))
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
    from engine import kv_cache_manager

    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, tokens, extra=None: 42)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), eos_token_id=None)
    _finish_turn(kv, first, [])
    other = Request("b", [9, 9, 9, 9, 5], SamplingParams(max_tokens=1), eos_token_id=None)
    assert kv.get_computed_blocks(other) == ([[]], 0)
    same = Request("c", [1, 2, 3, 4, 6], SamplingParams(max_tokens=1), eos_token_id=None)
    assert kv.get_computed_blocks(same) == ([first.block_ids[:1]], 4)
