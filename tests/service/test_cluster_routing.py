"""Prefix-affinity routing against fake replicas: no Ray, no cluster (``stencil.service.cluster.affinity``)."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from stencil.engine.kv_cache_manager import prompt_block_hashes
from stencil.service.cluster.affinity import AffinityConfig, PrefixAffinityPolicy, ReplicaView, rendezvous
from stencil.service.cluster.tracking import ReplicaTracker

CHAIN = [101, 102, 103, 104, 105]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _policy(**kw) -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy(AffinityConfig(**kw), clock=FakeClock())


def test_longest_cached_prefix_wins():
    p = _policy()
    a = ReplicaView("a", frozenset(CHAIN[:2]))
    b = ReplicaView("b", frozenset(CHAIN[:4]), queue_len=2)
    c = ReplicaView("c")
    d = p.rank(CHAIN, [a, b, c])
    assert (d.reason, d.matched_blocks) == ("match", 4)
    assert d.ranks == [["b"], ["a"], ["c"]]  # every replica ranked, one per rank: Serve falls through


def test_match_stops_at_the_first_missing_block():
    p = _policy()
    gap = ReplicaView("a", frozenset([CHAIN[0], CHAIN[2], CHAIN[3]]))  # block 1 evicted
    assert p.match_blocks(CHAIN, gap) == 1
    assert p.match_blocks(CHAIN, ReplicaView("b", frozenset(CHAIN[1:]))) == 0


def test_a_miss_goes_to_the_replica_holding_the_fewest_blocks():
    p = _policy(imbalance_threshold=4)
    d = p.rank(CHAIN, [ReplicaView("a", frozenset(range(50)), queue_len=1),
                       ReplicaView("b", frozenset(range(10)), queue_len=3),
                       ReplicaView("c", frozenset([999]), queue_len=2)])
    assert (d.reason, d.ranks) == ("miss", [["c"], ["b"], ["a"]])
    # Blocks just routed count too, before any report shows them.
    p.record_routed("c", [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    assert p.rank(CHAIN, [ReplicaView("b", frozenset(range(10))), ReplicaView("c", frozenset([999]))]).ranks == [
        ["b"], ["c"]]
    # Equal footprints: the shorter queue.
    d = p.rank(CHAIN, [ReplicaView("a", queue_len=2), ReplicaView("b", queue_len=1)])
    assert d.ranks == [["b"], ["a"]]


def test_a_miss_goes_to_the_least_loaded_replica_when_queues_are_uneven():
    p = _policy(imbalance_threshold=4)
    d = p.rank(CHAIN, [ReplicaView("a", queue_len=6), ReplicaView("b", frozenset(range(50)), queue_len=1),
                       ReplicaView("c", frozenset([999]), queue_len=2)])
    assert (d.reason, d.ranks) == ("miss", [["b"], ["c"], ["a"]])
    # Equal queues: the fuller KV cache goes last.
    d = p.rank(CHAIN, [ReplicaView("a", queue_len=6), ReplicaView("b", kv_usage=0.9),
                       ReplicaView("c", kv_usage=0.1)])
    assert d.ranks == [["c"], ["b"], ["a"]]


def test_a_busy_match_gives_way_beyond_the_imbalance_threshold():
    p = _policy(imbalance_threshold=4)
    hot = frozenset(CHAIN)
    d = p.rank(CHAIN, [ReplicaView("a", hot, queue_len=5), ReplicaView("b", queue_len=1)])
    assert (d.reason, d.ranks) == ("match", [["a"], ["b"]])  # a gap of 4 is within the threshold
    d = p.rank(CHAIN, [ReplicaView("a", hot, queue_len=6), ReplicaView("b", queue_len=1)])
    assert (d.reason, d.ranks) == ("imbalance", [["b"], ["a"]])
    # When it falls back, a replica holding the prefix still goes first among the least loaded.
    d = p.rank(CHAIN, [ReplicaView("a", hot, queue_len=6), ReplicaView("b", queue_len=1),
                       ReplicaView("c", frozenset(CHAIN[:2]), queue_len=1)])
    assert (d.reason, d.ranks, d.matched_blocks) == ("imbalance", [["c"], ["b"], ["a"]], 2)


def test_min_match_blocks_turns_a_short_match_into_a_miss():
    p = _policy(min_match_blocks=3)
    d = p.rank(CHAIN, [ReplicaView("a", frozenset(CHAIN[:2]), queue_len=1), ReplicaView("b")])
    assert (d.reason, d.ranks) == ("miss", [["b"], ["a"]])


def test_what_was_just_routed_counts_as_cached_until_the_ttl():
    clock = FakeClock()
    p = PrefixAffinityPolicy(AffinityConfig(optimistic_ttl_s=10.0), clock=clock)
    views = [ReplicaView("a"), ReplicaView("b")]
    first = p.rank(CHAIN, views)
    assert first.reason == "miss"
    chosen = first.ranks[0][0]
    p.record_routed(chosen, CHAIN[:3])
    clock.now += 9.0
    d = p.rank(CHAIN, [ReplicaView("a", queue_len=1), ReplicaView("b", queue_len=1)])
    assert (d.reason, d.ranks[0], d.matched_blocks) == ("match", [chosen], 3)
    clock.now += 2.0  # 11 s after: the replica's report should have shown it by now
    assert p.rank(CHAIN, views).reason == "miss"


def test_recorded_blocks_are_bounded_and_forgotten():
    p = _policy(max_recorded_blocks=3)
    p.record_routed("a", CHAIN)
    assert p.match_blocks(CHAIN, ReplicaView("a")) == 0  # the first two were dropped (oldest first)
    assert p.match_blocks(CHAIN[2:], ReplicaView("a")) == 3
    p.record_routed("b", CHAIN)
    p.keep_only({"b"})
    assert p.match_blocks(CHAIN[2:], ReplicaView("a")) == 0
    p.forget("b")
    assert p.match_blocks(CHAIN[2:], ReplicaView("b")) == 0


def test_a_new_prefix_lands_on_the_same_replica_in_any_candidate_order():
    p = _policy()
    views = [ReplicaView(r) for r in ("a", "b", "c")]
    first = p.rank(CHAIN, views).ranks
    assert p.rank(CHAIN, list(reversed(views))).ranks == first
    assert first[0] == [max("abc", key=lambda r: rendezvous(CHAIN[0], r))]
    # Different prefixes spread over the replicas.
    firsts = [p.rank([k], views).ranks[0][0] for k in range(60)]
    assert {r: firsts.count(r) >= 10 for r in "abc"} == {"a": True, "b": True, "c": True}


def test_no_full_block_ranks_by_load():
    d = _policy().rank([], [ReplicaView("a", queue_len=2), ReplicaView("b")])
    assert (d.reason, d.ranks) == ("no_prefix", [["b"], ["a"]])
    assert _policy().rank(CHAIN, []).ranks == []


@pytest.mark.parametrize("field_name, value", [("imbalance_threshold", -1), ("min_match_blocks", 0),
                                               ("optimistic_ttl_s", -1.0), ("max_recorded_blocks", -1)])
def test_bad_config_names_the_field(field_name, value):
    with pytest.raises(ValueError, match=field_name):
        AffinityConfig(**{field_name: value}).validate()


# -- the tracker, with Serve-shaped fake replicas -----------------------------------------------

@dataclass
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    replica_id: FakeId
    routing_stats: dict = field(default_factory=dict)


def test_tracker_reads_reports_and_counts_its_own_requests():
    t = ReplicaTracker(_policy(imbalance_threshold=1))
    a = FakeReplica(FakeId("a"), {"block_hashes": CHAIN, "running": 1, "waiting": 0, "kv_usage": 0.5, "seq": 1})
    b = FakeReplica(FakeId("b"))
    assert t.rank(CHAIN, [a, b]) == [[a], [b]]
    t.routed("r1", "a", CHAIN)
    t.routed("r2", "a", CHAIN)
    t.routed("r3", "a", CHAIN)
    assert t.view(a).queue_len == 3  # its own count beats the stale report of 1
    # a's queue (3) exceeds b's (0) by more than 1: the match gives way.
    assert t.decide(CHAIN, [a, b]).reason == "imbalance"
    t.completed("r1")
    t.completed("r2")
    t.completed("unknown")  # never counted: ignored
    assert t.inflight("a") == 1
    assert t.decide(CHAIN, [a, b]).reason == "match"
    # A new report replaces the hash set (seq changed); the same seq keeps the old one.
    a.routing_stats = {**a.routing_stats, "block_hashes": [], "seq": 2}
    assert t.view(a).cached == frozenset()
    t.died("a")
    assert t.inflight("a") == 0
    t.completed("r3")  # completion of a request on the dead replica: no effect
    assert t.inflight("a") == 0


def test_tracker_moves_the_count_of_a_rerouted_request_and_drops_departed_replicas():
    t = ReplicaTracker(_policy())
    t.routed("r1", "a", CHAIN)
    t.routed("r1", "b", CHAIN)  # Serve re-routed the same request
    assert (t.inflight("a"), t.inflight("b")) == (0, 1)
    t.keep_only(["a"])
    assert t.inflight("b") == 0
    assert t.policy.match_blocks(CHAIN, ReplicaView("b")) == 0


# -- a shared-prefix load on simulated replicas with finite caches -------------------------------

class SimReplica:
    """A prefix cache of ``capacity`` blocks with LRU eviction, reporting at once.

    As in ``BlockPool``, a finished request's blocks are freed last block first, so its tail
    (the user's own blocks) is evicted before the shared head."""

    def __init__(self, name: str, capacity: int):
        self.name = name
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, chain: list[int]) -> int:
        hit = 0
        for h in chain:
            if h not in self.blocks:
                break
            hit += 1
        for h in reversed(chain):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


def _shared_prefix_load(n_prompts: int, n_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(17, 49152) for _ in range(320)] for _ in range(n_prompts)]
    out = []
    for _ in range(n_requests):
        user = [rng.randrange(17, 49152) for _ in range(rng.randrange(20, 40))]
        out.append(prompt_block_hashes(rng.choice(systems) + user, 16))
    return out


def _hit_rate(load: list[list[int]], route) -> tuple[float, dict[int, set[str]]]:
    """(hit rate, first block -> replicas that served it) of ``load`` routed by ``route``."""
    replicas = [SimReplica("a", 90), SimReplica("b", 90)]  # each holds about 4 of the 8 prefixes
    hits = total = 0
    placed: dict[int, set[str]] = {}
    for i, chain in enumerate(load):
        r = route(i, chain, replicas)
        placed.setdefault(chain[0], set()).add(r.name)
        hits += r.serve(chain)
        total += len(chain)
    return hits / total, placed


def test_affinity_beats_round_robin_when_caches_are_finite():
    """8 system prompts of 20 blocks, two replicas with room for about 4 each: round-robin makes
    each cache hold all 8 and thrash; affinity splits them."""
    load = _shared_prefix_load(8, 400)
    policy = _policy()

    def affinity(i, chain, replicas):
        views = [ReplicaView(r.name, frozenset(r.blocks)) for r in replicas]
        name = policy.rank(chain, views).ranks[0][0]
        return next(r for r in replicas if r.name == name)

    rr, rr_placed = _hit_rate(load, lambda i, chain, replicas: replicas[i % 2])
    aff, aff_placed = _hit_rate(load, affinity)
    assert aff >= rr + 0.2, (aff, rr)
    assert all(len(names) == 2 for names in rr_placed.values())  # each prompt cached twice
    # Affinity caches most prompts once, and gives each replica about half of them.
    assert sum(len(names) for names in aff_placed.values()) <= 8 * 1.25, aff_placed
    for name in "ab":
        assert 3 <= sum(1 for names in aff_placed.values() if name in names) <= 5, aff_placed
