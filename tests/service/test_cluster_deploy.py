"""The cluster's entry points without a running Ray: the CLI's refusal without Ray Serve, the
Serve application ``build_app`` / ``stencil.cluster:app`` describe, and option checks."""

from __future__ import annotations

import sys

import pytest

from stencil.engine.config import ConfigError
from stencil.service import cli


def test_replicas_without_ray_fails_with_the_install_command(monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    rc = cli.main(["serve", "--replicas", "2", "--model", str(tiny_model_dir)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--replicas needs Ray Serve" in err and "pip install 'stencil-serve[cluster]'" in err


def test_bad_cluster_options_name_the_field(capsys, tiny_model_dir):
    pytest.importorskip("ray.serve")
    assert cli.main(["serve", "--replicas", "0", "--model", str(tiny_model_dir)]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    assert cli.main(["serve", "--replicas", "3", "--max-replicas", "2", "--model", str(tiny_model_dir)]) == 2
    assert "max_replicas (2) must be >= replicas (3)" in capsys.readouterr().err


def test_cluster_options_validate():
    from stencil.service.cluster.deploy import ClusterOptions

    with pytest.raises(ConfigError, match="router must be one of affinity"):
        ClusterOptions(router="random").validate()
    with pytest.raises(ConfigError, match="routing_stats_period_s"):
        ClusterOptions(routing_stats_period_s=0).validate()


def test_the_builder_makes_the_application_it_is_asked_for(tiny_model_dir):
    pytest.importorskip("ray.serve")
    import stencil.cluster

    app = stencil.cluster.app({"model": str(tiny_model_dir), "replicas": "2", "max_replicas": "4",
                               "router": "round_robin", "max_num_seqs": "10", "num_threads": "1"})
    ingress = app._bound_deployment
    assert ingress.name == "StencilIngress"
    replicas_app, engine_config, _, settings = ingress.init_args
    assert (engine_config.max_num_seqs, engine_config.num_threads) == (10, 1)
    assert settings.block_size == engine_config.block_size
    replica = replicas_app._bound_deployment
    cfg = replica._deployment_config
    assert replica.name == "EngineReplica"
    assert replica.max_ongoing_requests == 10  # the engine's batch
    assert replica.max_queued_requests == engine_config.max_waiting
    assert (cfg.autoscaling_config.min_replicas, cfg.autoscaling_config.max_replicas) == (2, 4)
    assert cfg.autoscaling_config.target_ongoing_requests == 8.0  # 80% of the batch
    assert cfg.autoscaling_config.downscale_delay_s == 600.0  # slow: a removed replica takes its cache
    assert cfg.request_router_config.request_router_class == "stencil.service.cluster.routers:RoundRobinRouter"
    assert cfg.request_router_config.request_routing_stats_period_s == 1.0
    fixed = stencil.cluster.app({"model": str(tiny_model_dir), "replicas": 3})._bound_deployment
    assert fixed.init_args[0]._bound_deployment.num_replicas == 3
    # The default model keeps its id on /v1 (as under `stencil serve`), whatever file serves it.
    from stencil.engine.models.default_model import MODEL_NAME

    assert stencil.cluster.app({})._bound_deployment.init_args[2].model_name == MODEL_NAME
    assert stencil.cluster.app({"model_name": "mine"})._bound_deployment.init_args[2].model_name == "mine"
    with pytest.raises(ValueError, match="unknown stencil.cluster arguments: colour"):
        stencil.cluster.app({"model": str(tiny_model_dir), "colour": "red"})


def test_the_kuberay_manifest_builds_with_this_code(tiny_model_dir):
    """examples/kuberay-rayservice.yaml is not run here, but its application arguments must be
    ones ``stencil.cluster:app`` takes (only the model path is swapped for a local one)."""
    pytest.importorskip("ray.serve")
    from pathlib import Path

    import yaml

    import stencil.cluster

    path = Path(__file__).resolve().parents[2] / "examples" / "kuberay-rayservice.yaml"
    manifest = yaml.safe_load(path.read_text())
    assert manifest["kind"] == "RayService"
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == __import__("ray").__version__
    (application,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    assert application["import_path"] == "stencil.cluster:app"
    args = {**application["args"], "model": str(tiny_model_dir)}
    replica = stencil.cluster.app(args)._bound_deployment.init_args[0]._bound_deployment
    assert replica.ray_actor_options["num_gpus"] == 1
    assert replica._deployment_config.autoscaling_config.max_replicas == args["max_replicas"]


class _FakeIngress:
    """Answers ``broadcast("drain")`` from a script of in-flight counts (the last repeats)."""

    def __init__(self, counts):
        self.counts, self.calls = list(counts), 0

    def broadcast(self, method):
        assert method == "drain"
        count = self.counts[min(self.calls, len(self.counts) - 1)]
        self.calls += 1
        return type("R", (), {"results": lambda _self, **kw: [count, RuntimeError("a dead replica")]})()


def _fake_time():
    now = [0.0]
    return (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))


def test_drain_waits_for_a_quiet_period_not_the_first_zero():
    from stencil.service.cluster.deploy import _drain

    # 0 in flight, then a request the proxy had accepted reaches the ingress, then it ends.
    ingress = _FakeIngress([0, 1, 1, 0])
    clock, sleep = _fake_time()
    _drain(ingress, grace_s=60, quiet_s=2.0, clock=clock, sleep=sleep)
    # Polls every 0.2 s: 4 scripted answers, then zeros until 2 s of quiet (10 more sleeps).
    assert ingress.calls == 4 + 10
    assert clock() == pytest.approx(0.2 * 13)


def test_drain_gives_up_after_the_grace_period():
    from stencil.service.cluster.deploy import _drain

    ingress = _FakeIngress([3])
    clock, sleep = _fake_time()
    _drain(ingress, grace_s=5, quiet_s=2.0, clock=clock, sleep=sleep)
    assert clock() == pytest.approx(5.0, abs=0.21)
