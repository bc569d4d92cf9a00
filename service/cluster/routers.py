"""Ray Serve request routers for the engine replicas, and the registry that names them.

``PrefixAffinityRouter`` is Stencil's: the policy of ``stencil.service.cluster.affinity`` over the
replicas' reported cached block hashes (``record_routing_stats``), with the router's own
in-flight counts and optimistic record (``stencil.service.cluster.tracking``). ``RoundRobinRouter`` is
the baseline the benchmark compares it with. Both implement Ray Serve 2.60's public
``ray.serve.request_router.RequestRouter``: ``choose_replicas`` returns ranked lists of
replicas and Serve takes the first one in rank order that accepts the request.

Imported only where Ray is installed (``pip install 'stencil-serve[cluster]'``); Serve loads
these classes in the ingress process by their import path (``stencil.service.cluster.ROUTERS``).
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from stencil.service.cluster.affinity import AffinityConfig, PrefixAffinityPolicy
from stencil.service.cluster.messages import ReplicaRequest
from stencil.service.cluster.tracking import ReplicaTracker

def _payload(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, ReplicaRequest):
            return arg
    return None


class PrefixAffinityRouter(RequestRouter):
    """Routes each generation to the replica caching the longest prefix of its prompt.

    Router kwargs (``RequestRouterConfig.request_router_kwargs``): the fields of
    ``stencil.service.cluster.affinity.AffinityConfig``.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self._tracker = ReplicaTracker(PrefixAffinityPolicy(AffinityConfig(**kwargs)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = _payload(pending_request)
        return self._tracker.rank(req.block_hashes if req is not None else [], candidate_replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        req = _payload(pending_request)
        self._tracker.routed(pending_request.metadata.internal_request_id, replica_id.unique_id,
                             req.block_hashes if req is not None else [])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._tracker.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._tracker.died(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._tracker.keep_only(r.replica_id.unique_id for r in replicas)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in id order, the others after it (the baseline)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        k = next(self._turn) % len(ordered)
        return [[r] for r in ordered[k:] + ordered[:k]]
