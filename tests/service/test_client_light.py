"""The typed client without the server: ``stencil.service.client`` imports and extracts with nothing
installed but httpx, msgspec and what they require.

The environment is built for the test: a directory holding exactly the installed files of httpx
and msgspec and of their requirements (read from their metadata, so it follows their versions),
put on the path of an interpreter started with ``-S`` (no site-packages: torch, transformers,
litestar and the rest of the server cannot be imported), beside Stencil's wheel unpacked (what
``pip install --no-deps`` of it puts in site-packages). The answer comes from httpx's mock
transport, so no server runs.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

CLIENT_DEPENDENCIES = ("httpx", "msgspec")

EXTRACT = r"""
import json, sys
import httpx, msgspec
from stencil.service.client import Client

class Person(msgspec.Struct):
    name: str
    age: int

def answer(request):
    body = json.loads(request.content)
    assert body["response_schema"]["required"] == ["name", "age"], body
    output = {"name": "Ada Lovelace", "age": 36}
    return httpx.Response(200, json={"id": "r", "text": json.dumps(output), "output": output, "valid": True,
                                     "finish_reason": "stop", "usage": {}, "timings": {}, "warnings": []})

with Client("http://stencil.invalid", transport=httpx.MockTransport(answer)) as client:
    print(client.extract(Person, "Ada Lovelace, 36, London"))
server = {"torch", "numpy", "transformers", "litestar", "engine", "grammar", "kernels", "schemas"}
print(sorted(server & {name.split(".")[0] for name in sys.modules}))
"""


def _closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need: themselves and their requirements, recursively
    (requirements of extras and of other platforms left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        dist = metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _site_of(dists: list[metadata.Distribution], site: Path) -> Path:
    """A directory of links to the top-level modules and packages of ``dists``."""
    site.mkdir()
    for dist in dists:
        for top in {f.parts[0] for f in dist.files or []}:
            if top in ("..", "__pycache__") or top.endswith((".dist-info", ".pth")):
                continue
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    return site


def _run(site: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path[:0] = [{str(site)!r}]\n"
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})


def test_client_extracts_with_only_httpx_and_msgspec(tmp_path, stencil_wheel):
    site = _site_of(_closure(CLIENT_DEPENDENCIES), tmp_path / "site")
    zipfile.ZipFile(stencil_wheel).extractall(site)
    # The environment really lacks the server: torch is not importable there.
    refused = _run(site, "import torch", tmp_path)
    assert refused.returncode != 0 and "No module named 'torch'" in refused.stderr
    done = _run(site, EXTRACT, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Person(name='Ada Lovelace', age=36)\n[]\n"
