"""Two tiny-model replicas on a real Ray Serve, inside a private network namespace.

Ray binds ports on every interface, so the run happens in a child process under ``unshare -n``
(``stencil.benchmarks.cluster`` re-executes itself there, loopback only) and reports JSON that this test
asserts on: the API answers through the cluster, prefix-affinity routing beats round-robin's
prefix-cache hit rate on a shared-prefix batch, both routers give the same greedy outputs, and a
replica killed while it streams loses no request and comes back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'stencil-serve[cluster]')")

ROOT = Path(__file__).resolve().parents[2]


def _namespaces_available() -> str | None:
    """Why a private network namespace cannot be made here, or None when it can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "`unshare` or `ip` is missing"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip() or probe.returncode}"
    return None


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    why = _namespaces_available()
    if why is not None:
        pytest.skip(f"Ray must run in a private network namespace: {why}")
    out = tmp_path_factory.mktemp("cluster") / "report.json"
    cmd = [sys.executable, "-m", "stencil.benchmarks.cluster", "--model", str(tiny_model_dir), "--replicas", "2",
           "--routers", "round_robin,affinity", "--prompts", "6", "--users", "4", "--prompt-sentences", "16",
           "--max-tokens", "24", "--concurrency", "4", "--kill-requests", "24", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "STENCIL_PRIVATE_NETNS"}
    # Idle it takes about 2 min; with both cores busy Ray alone starts in minutes (CI runs loaded).
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_api_answers_through_the_cluster(report):
    api = report["api"]
    assert api["health_lists_replicas"] == 2
    assert api["metrics_per_replica"] == 2
    assert api["bad_schema_stream_status"] == 400  # a replica's refusal, before the first byte
    assert (api["chat_status"], api["schema_status"]) == (200, 200)


def test_affinity_routing_raises_the_prefix_hit_rate(report):
    rr, aff = report["round_robin"], report["affinity"]
    assert rr["errors"] == 0 and aff["errors"] == 0
    assert rr["requests"] == aff["requests"] == 24
    assert sum(rr["requests_per_replica"]) == sum(aff["requests_per_replica"]) == 24
    assert rr["requests_per_replica"] == [12, 12]
    # Caches sized for about half the prompts: round-robin makes each replica hold all 6, affinity 3.
    assert aff["prefix_hit_rate"] >= rr["prefix_hit_rate"] + 0.15, (aff, rr)


def test_every_router_gives_the_same_greedy_outputs(report):
    assert report["outputs_identical"] is True


def test_a_replica_killed_mid_stream_loses_nothing(report):
    kill = report["replica_kill"]
    assert kill["killed_after_answers"] is not None  # the kill happened while a request streamed
    assert (kill["sent"], kill["answered"], kill["lost"], kill["wrong"]) == (24, 24, 0, 0), kill
    assert kill["replays"] >= 1  # the streaming request was re-sent and replayed
    assert kill["restarted_s"] is not None  # Serve brought the replica back


def test_sigterm_drains_the_cluster(tiny_model_dir):
    """``stencil serve --replicas 1``: SIGTERM refuses new requests (503) and lets the one in
    flight finish, then exits 0."""
    why = _namespaces_available()
    if why is not None:
        pytest.skip(f"Ray must run in a private network namespace: {why}")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
                           str(ROOT / "tests" / "cluster_drain.py"), str(tiny_model_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["health_after_sigterm"] == "draining"
    assert out["new_request_status"] == 503
    assert out["long"] == {"status": 200, "finish_reason": "stop", "valid": True}
    assert out["exit_status"] == 0
