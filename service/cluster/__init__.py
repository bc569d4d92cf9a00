"""Past one machine: engine replicas on Ray Serve behind one Litestar ingress.

* ``affinity`` — the prefix-affinity routing policy (no Ray); ``tracking`` — the router's book
  of replicas; ``routers`` — the Ray Serve ``RequestRouter`` s.
* ``messages`` — what ingress and replicas send each other; ``client`` — ``ClusterEngine``, the
  engine-shaped client the ingress app runs on; ``stream`` — one request's admission, outputs
  and failover with replay; ``replica`` — the engine replica deployment; ``deploy`` — the Serve
  application and ``stencil serve --replicas N``.

Only ``routers`` and ``deploy``'s functions need Ray (``pip install 'stencil-serve[cluster]'``).
"""

#: Router names (``ClusterOptions.router``) -> import path of the Ray Serve ``RequestRouter``.
#: "ray_prefix" is Ray's own PrefixCacheAffinityRouter (a prefix tree of prompt characters in a
#: detached actor), imported from its module because ``ray.serve.llm`` itself needs pyarrow.
ROUTERS: dict[str, str] = {
    "affinity": "stencil.service.cluster.routers:PrefixAffinityRouter",
    "round_robin": "stencil.service.cluster.routers:RoundRobinRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "ray_prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
                  ":PrefixCacheAffinityRouter",
}
