"""How every KSpeed process logs: one text format, or JSON lines for log collectors.

``log_format: json`` (or ``KSPEED_LOG_FORMAT=json``) writes one JSON object per line with
``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``pid``, ``process`` (manager, server,
feeder) and, for errors with a traceback, ``exception``: what journald, Loki, Fluent Bit and
Elasticsearch ingest without a parsing rule.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys

__all__ = ["JsonFormatter", "LogSettings"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(kspeed_process)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "process": self._process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _ProcessName(logging.Filter):
    """Adds ``[feeder 1234]`` style context to text records of helper processes."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        self._suffix = suffix

    def filter(self, record: logging.LogRecord) -> bool:
        record.kspeed_process = self._suffix
        return True


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """A process's log level and format (``text`` or ``json``), as configured."""

    level: str = "info"
    format: str = "text"

    def apply(self, process: str, *, helper: bool = False) -> None:
        """Send this process's logs to stderr in the configured format, replacing earlier handlers.

        Args:
            process: the component name written with every record (``manager``, ``server``, ``feeder``).
            helper: a helper process of a daemon (its text records name it and its pid).
        """
        handler = logging.StreamHandler(sys.stderr)
        if self.format == "json":
            handler.setFormatter(JsonFormatter(process))
        else:
            handler.setFormatter(logging.Formatter(TEXT_FORMAT))
            handler.addFilter(_ProcessName(f"[{process} {os.getpid()}]" if helper else ""))
        root = logging.getLogger()
        for old in list(root.handlers):
            root.removeHandler(old)
        root.addHandler(handler)
        root.setLevel(getattr(logging, self.level.upper()))
