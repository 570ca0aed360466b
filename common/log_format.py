"""How every shuttle process writes its log: text lines, or one JSON object per line (`--log-format json`).

The launcher sets LOG_FORMAT_ENV for its children, as it sets the level (common/config.py's LOG_LEVEL_ENV). A JSON
line carries `time` (ISO 8601, UTC), `level`, `process` (frontend, scheduler, worker, ...), `logger`, `message`,
`group` (the serving group of an engine process, or of the request a frontend line is about), `request_id` on every
line about one request, and `exception` with the traceback where there is one. Log shippers (Loki, Fluent Bit,
CloudWatch) index these fields without a parsing rule.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

LOG_FORMAT_ENV = "SHUTTLE_LOG_FORMAT"  # every process's log format (`shuttle serve --log-format` sets it)
LOG_FORMATS = ("text", "json")
REQUEST_FIELDS = ("request_id", "group")  # passed as `extra=` by the lines about one request


def log_format() -> str:
    """This process's log format: "json" when LOG_FORMAT_ENV says so, else "text"."""
    return "json" if os.environ.get(LOG_FORMAT_ENV, "").lower() == "json" else "text"


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record (the fields are in the module's docstring).

    Args:
        process: the process's role, on every line.
        group: the serving group of an engine process (None: the frontend or launcher, whose lines name the group of
            the request they are about, if any).
    """

    def __init__(self, process: str, group: int | None = None):
        super().__init__()
        self.process = process
        self.group = group

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.group is not None:
            entry["group"] = self.group
        for name in REQUEST_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(process: str, level: str, group: int | None = None) -> None:
    """Set up the root logger of a shuttle process on stderr, in the format LOG_FORMAT_ENV names.

    Args:
        process: the role named on every line.
        level: a logging level name ("INFO").
        group: the serving group of an engine process (None elsewhere).
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format() == "json":
        handler.setFormatter(JsonLogFormatter(process, group))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def launcher_line(message: str, data: dict | None = None, level: str = "INFO") -> str:
    """One line of the launcher's own output, "shuttle: MESSAGE" with `data` as JSON after it; under --log-format
    json one JSON object whose `message` is that same text and whose `data` holds `data` as fields, for a log
    shipper to index (the ready line's URL and pids)."""
    text = message if data is None else f"{message} {json.dumps(data)}"
    if log_format() != "json":
        return f"shuttle: {text}"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    entry: dict[str, object] = {"time": now, "level": level, "process": "launcher", "logger": "shuttle.launcher",
                                "message": text}
    if data is not None:
        entry["data"] = data
    return json.dumps(entry, ensure_ascii=False)
