"""The router's book of replicas: their reported stats, its own in-flight counts, its routing.

Works on anything shaped like Ray Serve's ``RunningReplica`` (``replica_id.unique_id``,
``routing_stats``), so it is tested with fakes; ``stencil.service.cluster.routers`` feeds it from the
``RequestRouter`` hooks.

What a replica reports (``EngineReplica.record_routing_stats``, see ``ROUTING_STATS_KEYS``):
``block_hashes`` (its cached blocks), ``running`` and ``waiting`` (engine queue), ``kv_usage``
and ``seq`` (a counter that changes with every report, so the hash set is rebuilt only then).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stencil.service.cluster.affinity import PrefixAffinityPolicy, ReplicaView, RoutingDecision

ROUTING_STATS_KEYS = ("block_hashes", "running", "waiting", "kv_usage", "seq")


class _ReplicaId(Protocol):
    unique_id: str


class ReplicaLike(Protocol):
    """The two attributes of Ray Serve's ``RunningReplica`` the router reads."""

    replica_id: _ReplicaId
    routing_stats: dict[str, Any]


@dataclass(slots=True)
class _Seen:
    seq: object
    cached: frozenset[int]


class ReplicaTracker:
    """Turns replicas and their reports into ``ReplicaView`` s and ranks them with the policy.

    Queue length is the larger of the router's own count of requests it sent and that have not
    finished (exact and immediate for this router) and the replica's reported
    ``running + waiting`` (which also counts what other routers sent, a report period late).
    """

    def __init__(self, policy: PrefixAffinityPolicy):
        self.policy = policy
        self._inflight: dict[str, int] = {}  # replica id -> requests routed, not completed
        self._routed: dict[str, str] = {}  # internal request id -> replica id
        self._seen: dict[str, _Seen] = {}  # replica id -> last report's hash set

    def view(self, replica: ReplicaLike) -> ReplicaView:
        """The policy's view of one replica now."""
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        seen = self._seen.get(rid)
        seq = stats.get("seq")
        if seen is None or seen.seq != seq:
            seen = _Seen(seq, frozenset(stats.get("block_hashes") or ()))
            self._seen[rid] = seen
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        return ReplicaView(rid, seen.cached, max(self._inflight.get(rid, 0), reported),
                           float(stats.get("kv_usage", 0.0)))

    def rank(self, chain: Sequence[int], replicas: Sequence[ReplicaLike]) -> list[list[ReplicaLike]]:
        """Ranked lists of the replicas themselves (what ``choose_replicas`` returns)."""
        decision = self.decide(chain, replicas)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return [[by_id[i] for i in rank] for rank in decision.ranks]

    def decide(self, chain: Sequence[int], replicas: Sequence[ReplicaLike]) -> RoutingDecision:
        return self.policy.rank(chain, [self.view(r) for r in replicas])

    def routed(self, internal_request_id: str, replica_id: str, chain: Sequence[int]) -> None:
        """A request was accepted by ``replica_id``: count it and record its prefix there."""
        if internal_request_id in self._routed:  # a retry that Serve re-routed: move the count
            self.completed(internal_request_id)
        self._routed[internal_request_id] = replica_id
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        self.policy.record_routed(replica_id, chain)

    def completed(self, internal_request_id: str) -> None:
        """A request ended (any way); requests this tracker never counted are ignored."""
        rid = self._routed.pop(internal_request_id, None)
        if rid is not None and self._inflight.get(rid, 0) > 0:
            self._inflight[rid] -= 1

    def inflight(self, replica_id: str) -> int:
        return self._inflight.get(replica_id, 0)

    def died(self, replica_id: str) -> None:
        """Forget a replica that died (its requests fail; their completions are ignored)."""
        self._inflight.pop(replica_id, None)
        self._seen.pop(replica_id, None)
        self.policy.forget(replica_id)
        for req in [q for q, r in self._routed.items() if r == replica_id]:
            del self._routed[req]

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids`` (Serve's updated replica set)."""
        live = set(replica_ids)
        for rid in [r for r in set(self._inflight) | set(self._seen) if r not in live]:
            self.died(rid)
        self.policy.keep_only(live)
