"""Logging on stderr: plain text lines for a person at a terminal, JSON lines for a log shipper.

Code logs with ``extra={"request_id": ..., ...}``; both formatters write every such extra field
(the JSON one as keys of the object, so a shipper can index and join on ``request_id``; the text
one as ``key=value``). ``log_format("auto")`` picks text when stderr is a terminal, else JSON.
uvicorn's ``color_message`` (its message again, with terminal colour codes) is never written.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else on a record came from ``extra=``. uvicorn adds
# ``color_message``: the same message with ANSI escape codes, noise in a file or a JSON field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName",
                                                                         "color_message"}
FORMATS = ("auto", "text", "json")


class JsonFormatter(logging.Formatter):
    """Formats a record as ``{"ts", "level", "logger", "msg", ...extra fields, "exc"?}``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` for people reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in vars(record).items()
                          if k not in _STANDARD and not k.startswith("_"))
        line = (f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname.lower():7s} "
                f"{record.name}: {record.getMessage()}" + (f" {extras}" if extras else ""))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def log_format(fmt: str = "auto", stream=None) -> str:
    """``fmt`` resolved: "auto" is "text" when ``stream`` (default: stderr) is a terminal, else
    "json"; "text" and "json" stand.

    Raises:
        ValueError: ``fmt`` is none of ``FORMATS``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    stream = sys.stderr if stream is None else stream
    return "text" if stream.isatty() else "json"


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Send all logs to stderr in ``fmt`` ("auto", "text" or "json": ``log_format``) at ``level``;
    replaces root handlers."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format(fmt) == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
