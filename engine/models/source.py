"""What a ``--model`` path names: a GGUF file, a directory holding one, or an HF-format directory.

Resolution order for a directory: ``config.json`` makes it an HF directory (its safetensors are
the weights; a GGUF beside them, if any, feeds the int4 layers, see ``loader.find_gguf``);
otherwise its single ``*.gguf`` file is the model. Several GGUF files and no ``config.json`` is
ambiguous: the error lists them so the user can name one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class ModelPathError(ValueError):
    """A ``--model`` path that names no model; the one-line message says what was found."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model path.

    Attributes:
        kind: ``"gguf"`` (weights, config and tokenizer all from one GGUF file) or ``"hf"``.
        path: the ``.gguf`` file, or the HF directory.
    """

    kind: str
    path: Path

    @property
    def name(self) -> str:
        """A model id for clients: the GGUF file's stem, or the directory's name."""
        return self.path.stem if self.kind == "gguf" else self.path.name


def resolve_model_path(path: Path | str) -> ModelSource:
    """Classify ``path`` (see the module docstring).

    Raises:
        ModelPathError: no such path, a file that is not ``.gguf``, a directory with neither
            ``config.json`` nor a ``.gguf``, or one with several ``.gguf`` files and no config.
    """
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelPathError(f"--model {path} is a file but not a .gguf; give a GGUF file, a directory "
                                 "with one, or an HF model directory (config.json + safetensors)")
        return ModelSource("gguf", path.resolve())
    if not path.is_dir():
        raise ModelPathError(f"--model {path}: no such file or directory")
    if (path / "config.json").is_file():
        return ModelSource("hf", path.resolve())
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) == 1:
        return ModelSource("gguf", found[0].resolve())
    if not found:
        raise ModelPathError(f"--model {path}: the directory has neither config.json (an HF model) nor a .gguf file")
    raise ModelPathError(f"--model {path}: the directory holds {len(found)} .gguf files "
                         f"({', '.join(p.name for p in found)}); name one")


__all__ = ["ModelPathError", "ModelSource", "resolve_model_path"]
