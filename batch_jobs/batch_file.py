"""`shuttle batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI batch file through shuttle's ZeroMQ batch endpoint.

Input lines (OpenAI's batch input format): {"custom_id": "...", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...the request body...}}.
Output lines (OpenAI's batch output format), one per input line, in completion order:
    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code", "request_id", "body"}, "error": null}
The server's answers, errors included (status 400 with an OpenAI error body naming the field), go in `response`,
as OpenAI does; a line that could not be sent at all (not JSON, no custom_id, a method other than POST, or none,
another key) gets `"response": null, "error": {"code": "invalid_line", "message", "line"}` (custom_id null when
unreadable; `line` its line number only then, else null: a rerun finds the line by its custom_id).

Resumable: OUTPUT is appended to, and a rerun skips every line already answered there (by custom_id; lines
without one by line number). Duplicate custom_ids are an error before anything is sent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from shuttle.batch_jobs.client import BatchClient, BatchServerGone
from shuttle.common.arg_types import positive, positive_number, zmq_endpoint


@dataclass
class Line:
    """One input line: a job to send, or (error set) an error to write without sending."""

    number: int  # 1-based
    custom_id: str | None
    job: dict | None = None
    error: str | None = None


def read_input(path: Path) -> list[Line]:
    """Parse every non-blank line. Raises ValueError listing duplicate custom_ids."""
    lines, seen, duplicates = [], set(), []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                line = _parse(number, text)
                if line.custom_id is not None:
                    if line.custom_id in seen:
                        duplicates.append(f"{line.custom_id!r} (line {number})")
                    seen.add(line.custom_id)
                lines.append(line)
    if duplicates:
        raise ValueError(f"duplicate custom_id in {path}: {', '.join(duplicates[:10])}"
                         + (f" and {len(duplicates) - 10} more" if len(duplicates) > 10 else ""))
    return lines


LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})  # an OpenAI batch input line's


def _parse(number: int, text: str) -> Line:
    try:
        data = json.loads(text)
    except ValueError as exc:
        return Line(number, None, error=f"line {number} is not JSON: {exc}")
    if not isinstance(data, dict):
        return Line(number, None, error=f"line {number} is not a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, error=f"line {number}: custom_id must be a non-empty string")
    if data.get("method") != "POST":  # required, as in OpenAI's batch input: a line without it is not sent
        return Line(number, custom_id, error=f"line {number}: method must be POST, got {data.get('method')!r}")
    unknown = sorted(set(data) - LINE_KEYS)
    if unknown:  # nothing is silently ignored
        return Line(number, custom_id, error=f"line {number}: key {unknown[0]!r} is not one of OpenAI's batch input "
                                             f"({', '.join(sorted(LINE_KEYS))})")
    # url and body go to the server as they are: it answers a bad one as an HTTP call would (400 naming the field)
    return Line(number, custom_id, job={"custom_id": custom_id, "url": data.get("url"), "body": data.get("body")})


def answered(path: Path) -> tuple[set[str], set[int]]:
    """custom_ids and line numbers (of lines without a custom_id) already in OUTPUT. A last line cut short by a
    crash mid-write is removed, so that the rerun writes it whole."""
    ids: set[str] = set()
    numbers: set[int] = set()
    if not path.exists():
        return ids, numbers
    raw = path.read_bytes()
    good = 0
    for chunk in raw.splitlines(keepends=True):
        try:
            record = json.loads(chunk)
        except ValueError:
            break
        if not chunk.endswith(b"\n"):
            break
        good += len(chunk)
        if record.get("custom_id") is not None:
            ids.add(record["custom_id"])
        elif (record.get("error") or {}).get("line") is not None:
            numbers.add(record["error"]["line"])
    if good < len(raw):
        with path.open("r+b") as f:
            f.truncate(good)
    return ids, numbers


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> str:
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                       "error": error}, ensure_ascii=False) + "\n"


def run(args: argparse.Namespace) -> int:
    """Run `shuttle batch`; returns the exit status (0: every line answered; 1: the server went away or another
    failure, OUTPUT holding what was answered; 2: bad input, nothing sent; 130: interrupted, OUTPUT holding what was
    answered)."""
    try:
        lines = read_input(Path(args.input))
    except (OSError, ValueError) as exc:  # (a file that is not UTF-8 is a ValueError naming only the byte)
        print(f"shuttle batch: {exc}" if args.input in str(exc) else f"shuttle batch: {args.input}: {exc}",
              file=sys.stderr)
        return 2
    output = Path(args.output)
    try:  # before anything is sent: a directory, a missing folder or no permission is one line, not a traceback
        done_ids, done_numbers = answered(output)
        out = output.open("a", encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"shuttle batch: cannot append to OUTPUT {output}: {exc}", file=sys.stderr)
        return 2
    todo = [line for line in lines if not (line.custom_id in done_ids if line.custom_id is not None
                                           else line.number in done_numbers)]
    errors = sum(1 for line in todo if line.error is not None)
    from tqdm import tqdm
    bar = tqdm(total=len(lines), initial=len(lines) - len(todo), unit="req", desc="batch", dynamic_ncols=True,
               disable=args.quiet)
    tokens, start, failed = 0, time.monotonic(), 0
    with out:
        for line in todo:
            if line.error is not None:  # nothing to send: its error line now
                out.write(_record(line.custom_id, None, {"code": "invalid_line", "message": line.error,
                                                         "line": None if line.custom_id else line.number}))
                bar.update()
        out.flush()
        jobs = (line.job for line in todo if line.job is not None)
        client = BatchClient(args.endpoint, args.max_in_flight, args.api_key, server_timeout=args.server_timeout)
        try:
            for result in client.run(_with_priority(jobs, args.priority)):
                body = result.body
                if result.status_code == 200 and isinstance(body, dict):
                    tokens += (body.get("usage") or {}).get("completion_tokens", 0)
                else:
                    failed += 1
                out.write(_record(result.job_id, {"status_code": result.status_code, "request_id": result.request_id,
                                                  "body": body}, None))
                out.flush()  # a crash loses no answered line
                bar.update()
                bar.set_postfix_str(f"{tokens / max(time.monotonic() - start, 1e-9):.0f} tok/s, {failed} failed",
                                    refresh=False)
        except BatchServerGone as exc:
            bar.close()
            print(f"shuttle batch: {exc}; {output} holds every answer received, rerun the same command to finish",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: the client's connection is closed as the loop unwinds
            bar.close()
            print(f"shuttle batch: interrupted; {output} holds every answer received, rerun the same command to "
                  f"finish", file=sys.stderr)
            return 130
    bar.close()
    print(f"{len(lines)} lines -> {output}: {len(todo) - errors - failed} answered 200 this run, "
          f"{failed} error responses, {errors} invalid lines, {len(lines) - len(todo)} already done")
    return 0


def _with_priority(jobs: Iterator[dict], priority: int | None) -> Iterator[dict]:
    """--priority: the `priority` of every body that sets none (the order among batch requests)."""
    for job in jobs:
        if priority is not None and isinstance(job["body"], dict) and "priority" not in job["body"]:
            job = {**job, "body": {**job["body"], "priority": priority}}
        yield job


def add_parser(commands) -> None:
    """The `shuttle batch` subcommand."""
    batch = commands.add_parser("batch", help="run an OpenAI batch file (JSONL) through a server's batch endpoint",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    batch.add_argument("input", metavar="INPUT.jsonl", help="OpenAI batch input: custom_id, method, url, body")
    batch.add_argument("output", metavar="OUTPUT.jsonl",
                       help="OpenAI batch output, appended to; a rerun skips the custom_ids already in it")
    batch.add_argument("--endpoint", default="tcp://127.0.0.1:8001", type=zmq_endpoint,
                       help="the server's batch endpoint")
    batch.add_argument("--max-in-flight", type=positive, default=64, help="most requests sent and not yet answered")
    batch.add_argument("--priority", type=int, default=None,
                       help="`priority` of every body without one (lower first, among batch requests, on a server "
                            "with --scheduling-policy priority; an fcfs server refuses a priority other than 0; batch "
                            "work always runs behind interactive traffic unless the server has --no-batch-background)")
    batch.add_argument("--api-key", default=None, help="the server's API key; when not given, $SHUTTLE_API_KEY is used")
    batch.add_argument("--server-timeout", type=positive_number, default=5.0,
                       help="seconds without a word from the server (it beats every second) before giving up")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
