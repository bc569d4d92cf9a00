"""The installed distribution claims one import name, ``stencil`` (setup.py maps the root folders
under it; docs/architecture.md, "One import name").

The wheel built from this tree (``stencil_wheel`` in tests/conftest.py; tests/test_layout.py checks
its top-level names), installed in a virtual environment beside Hugging Face's ``kernels``
distribution and the newest transformers the package registry offers, imports and serves a
constrained ``/generate``. Our old top-level ``kernels`` package shadowed Hugging Face's, which
transformers >= 5.25 imports: that is what this guards. It needs the registry and is skipped where
it cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

def _registry_reachable() -> bool:
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "kernels"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "kernels" in proc.stdout


SERVE = textwrap.dedent("""
    import json, sys
    import kernels, transformers
    import stencil.engine, stencil.kernels
    from litestar.testing import TestClient
    from stencil.engine.config import EngineConfig
    from stencil.service.app import create_app

    app = create_app(EngineConfig(model=sys.argv[1], num_kv_blocks=64, max_num_seqs=2))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with TestClient(app) as client:
        r = client.post("/generate", json={"prompt": "x", "response_schema": schema, "max_tokens": 40})
    print(json.dumps({"status": r.status_code, "body": r.json(), "kernels": kernels.__file__,
                      "stencil_kernels": stencil.kernels.__file__,
                      "kernels_has_get_kernel": hasattr(kernels, "get_kernel"), "stencil": stencil.engine.__file__,
                      "transformers": transformers.__version__}))
""")


@pytest.mark.skipif(not _registry_reachable(), reason="the package registry cannot be reached")
def test_the_wheel_serves_beside_hugging_face_kernels_and_the_newest_transformers(stencil_wheel, tmp_path,
                                                                                   tiny_model_dir):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The test environment's packages (torch, litestar, ...) come after the new venv's own, by a path
    # line: its .pth files (the editable install's finder) are not run, so only the wheel is Stencil.
    (site / "zz_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    proc = subprocess.run([*pip, "--upgrade", "--upgrade-strategy", "only-if-needed", "transformers", "kernels"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([*pip, "--no-deps", str(stencil_wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    newest = subprocess.run([str(py), "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                            text=True, timeout=60).stdout.split("(")[1].split(")")[0]

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(py), "-c", SERVE, str(tiny_model_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["transformers"] == newest
    # Hugging Face's (the new venv's, or the test environment's where it already had the newest), not ours.
    assert out["kernels"].endswith("site-packages/kernels/__init__.py") and out["kernels_has_get_kernel"], out
    assert out["stencil"].startswith(str(venv)) and out["stencil_kernels"].startswith(str(venv)), out
    assert out["status"] == 200, out["body"]
    assert out["body"]["valid"] is True
    assert isinstance(json.loads(out["body"]["text"])["n"], int)
