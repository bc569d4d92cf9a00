"""Stencil on Ray Serve, for Ray users.

As a Serve application builder (``serve run``, or ``import_path`` in a KubeRay ``RayService``;
see ``examples/kuberay-rayservice.yaml``)::

    serve run stencil.cluster:app model=/models/SmolLM2-135M-Instruct replicas=2 router=affinity

or from Python, in a process connected to Ray::

    from ray import serve
    from stencil.cluster import ClusterOptions, EngineConfig, build_app

    serve.run(build_app(EngineConfig(model=path), options=ClusterOptions(replicas=4, replica_gpus=1)),
              name="stencil", route_prefix="/")

The HTTP API is the one ``stencil serve`` offers (``/generate``, the OpenAI routes, ``/health``
listing each replica, ``/metrics`` with per-replica series). Needs ``pip install
'stencil-serve[cluster]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stencil.engine.config import EngineConfig
from stencil.service.cluster.cluster_engine import ClusterSettings
from stencil.service.cluster.deploy import ClusterOptions, build_app, serve_cluster
from stencil.service.state import ServiceConfig

__all__ = ["ClusterOptions", "ClusterSettings", "EngineConfig", "ServiceConfig", "app", "build_app",
           "serve_cluster"]

# Builder argument -> (where it goes, its type). Values may arrive as strings (``serve run k=v``).
_ENGINE = {"device": str, "dtype": str, "weights": str, "prompt_weights": str, "kv_cache_dtype": str,
           "kv_cache_gib": float, "num_kv_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
           "max_model_len": int, "max_waiting": int, "num_threads": int, "attention_backend": str}
_OPTIONS = {"replicas": int, "max_replicas": int, "target_ongoing_requests": float, "router": str,
            "replica_cpus": float, "replica_gpus": float, "ingress_replicas": int,
            "downscale_delay_s": float, "upscale_delay_s": float, "max_queued_requests": int,
            "graceful_shutdown_s": float}
_SERVICE = {"api_key": str, "model_name": str, "max_tokens_cap": int, "request_timeout_s": float}


def app(args: dict[str, Any]):
    """Serve application builder: ``model`` (a directory on every node; default: the default
    model, fetched into the cache), then any field named in ``_ENGINE`` (``EngineConfig``),
    ``_OPTIONS`` (``ClusterOptions``) or ``_SERVICE`` (``ServiceConfig``).

    Raises:
        ValueError: an unknown argument, or a value that does not parse as its type.
    """
    unknown = set(args) - {"model"} - set(_ENGINE) - set(_OPTIONS) - set(_SERVICE)
    if unknown:
        raise ValueError(f"unknown stencil.cluster arguments: {', '.join(sorted(unknown))}")

    def pick(table: dict) -> dict:
        return {k: table[k](v) for k, v in args.items() if k in table and v is not None}

    model, service = args.get("model"), pick(_SERVICE)
    if model is None:
        from stencil.engine.models.default_model import MODEL_NAME, ensure_default_model

        model = ensure_default_model()
        service.setdefault("model_name", MODEL_NAME)  # its id, as `stencil serve` gives it, not the file's
    scfg = ServiceConfig(**service)
    opts = ClusterOptions(**pick(_OPTIONS))
    return build_app(EngineConfig(model=Path(model), **pick(_ENGINE)), scfg, opts)
