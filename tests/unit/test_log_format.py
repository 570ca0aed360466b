"""Issue 46: --log-format json's lines (common/log_format.py): the launcher's own, with their data as fields, and a
process's records with the request fields and tracebacks."""

from __future__ import annotations

import json
import logging
import sys

from shuttle.common.log_format import LOG_FORMAT_ENV, JsonLogFormatter, launcher_line


def test_the_launchers_line_is_text_or_one_json_object_with_its_data(monkeypatch):
    monkeypatch.delenv(LOG_FORMAT_ENV, raising=False)
    assert launcher_line("ready", {"url": "http://x", "pids": {"worker": 7}}) == \
        'shuttle: ready {"url": "http://x", "pids": {"worker": 7}}'
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    entry = json.loads(launcher_line("ready", {"url": "http://x", "pids": {"worker": 7}}))
    assert entry["process"] == "launcher" and entry["level"] == "INFO"
    assert entry["message"] == 'ready {"url": "http://x", "pids": {"worker": 7}}'
    assert entry["data"] == {"url": "http://x", "pids": {"worker": 7}}  # indexable fields, not only text
    assert "data" not in json.loads(launcher_line("stopping"))


def test_a_record_names_its_process_group_request_and_traceback():
    formatter = JsonLogFormatter("scheduler", group=1)
    record = logging.LogRecord("shuttle.scheduler", logging.WARNING, __file__, 1, "request %s: %d", ("r-0", 3), None)
    record.request_id = "r-0"
    entry = json.loads(formatter.format(record))
    assert (entry["process"], entry["group"], entry["request_id"], entry["message"], entry["level"]) == \
        ("scheduler", 1, "r-0", "request r-0: 3", "WARNING")
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("shuttle", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    entry = json.loads(JsonLogFormatter("frontend").format(failed))
    assert "group" not in entry and "ValueError: boom" in entry["exception"]
