"""The installed distribution claims one import name, ``stencil`` (setup.py maps the root folders
under it; docs/architecture.md, "One import name").

Two checks: the wheel built from this tree holds ``stencil/`` and its dist-info and nothing else at
its top level (with every folder's modules and data in place); and that wheel, installed in a
virtual environment beside Hugging Face's ``kernels`` distribution and the newest transformers the
package registry offers, imports and serves a constrained ``/generate``. Our old top-level
``kernels`` package shadowed Hugging Face's, which transformers >= 5.25 imports: that is what the
second test guards. It needs the registry and is skipped where it cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "service", "grammar", "kernels", "schemas", "benchmarks")


def _source_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files of the tree (no build/, no .venv), copied."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built without network (setuptools from the test environment)."""
    work = tmp_path_factory.mktemp("wheel")
    src = _source_copy(work / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(src)], check=True, capture_output=True)
    (built,) = (work / "dist").glob("stencil_serve-*.whl")
    return built


def test_the_wheel_claims_only_the_stencil_import_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"stencil"}, top
    assert len(dist_info) == 1
    # Every root folder's modules made it under stencil/, and the data the code reads at run time.
    for folder in FOLDERS:
        expected = {f"stencil/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")
                    if "__pycache__" not in p.parts}
        assert expected <= set(names), sorted(expected - set(names))[:5]
    assert {f"stencil/kernels/csrc/{p.name}" for p in (ROOT / "kernels" / "csrc").glob("*.c")} <= set(names)
    assert any(n.startswith("stencil/benchmarks/data/") for n in names)
    entry = zipfile.ZipFile(wheel).read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "stencil = stencil.service.cli:main" in entry


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
                      "stencil_kernels": stencil.kernels.__file__, "stencil": stencil.engine.__file__,
                      "transformers": transformers.__version__}))
""")


@pytest.mark.skipif(not _registry_reachable(), reason="the package registry cannot be reached")
def test_the_wheel_serves_beside_hugging_face_kernels_and_the_newest_transformers(wheel, tmp_path,
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
    proc = subprocess.run([*pip, "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    newest = subprocess.run([str(py), "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                            text=True, timeout=60).stdout.split("(")[1].split(")")[0]

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(py), "-c", SERVE, str(tiny_model_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["transformers"] == newest
    assert out["kernels"].startswith(str(venv)), out  # Hugging Face's, not ours
    assert out["stencil"].startswith(str(venv)) and out["stencil_kernels"].startswith(str(venv)), out
    assert out["status"] == 200, out["body"]
    assert out["body"]["valid"] is True
    assert isinstance(json.loads(out["body"]["text"])["n"], int)
