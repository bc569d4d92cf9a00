"""What the two chat-format registries share (``stencil.service.tool_formats``: tool-call syntaxes;
``stencil.service.reasoning_formats``: reasoning markers): a detector over a chat template's text,
the first registered format whose detector matches, and the one-line error for an unknown name.
No heavy imports: the command line lists the names for ``--help``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from stencil.engine.config import ConfigError

F = TypeVar("F")


def has(*needles: str) -> Callable[[str], bool]:
    """A detector: whether a template's text holds every one of ``needles``."""
    return lambda template: all(n in template for n in needles)


def first_detected(formats: Iterable[F], template: str | None) -> F | None:
    """The first of ``formats`` (most specific first) whose ``detect`` takes ``template``, or
    ``None`` (no template, or none matches)."""
    if not template:
        return None
    return next((f for f in formats if f.detect(template)), None)  # type: ignore[attr-defined]


def check_known(field: str, name: str | None, known: Mapping[str, Any], words: tuple[str, ...]) -> None:
    """Accept ``None``, one of ``words`` (``"auto"``, ...) or a name in ``known``.

    Raises:
        ConfigError: naming ``field`` and listing what is accepted (one line).
    """
    if name is None or name in words or name in known:
        return
    raise ConfigError(f"{field} {name!r} is not known; use {', '.join(words)} or one of: {', '.join(known)}")
