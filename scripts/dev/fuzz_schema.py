#!/usr/bin/env python3
"""Schema-driven fuzzing of the HTTP API: schemathesis against the server's own /openapi.json.

Starts a server (launcher/local_server.py's ShuttleServer on stories260K, or --url for a running one), runs
`schemathesis run` on its document with the checks that compare behaviour with the document, and reports:

- cases: requests sent, by operation and status;
- 5xx: answers with a server error (any is a bug), 503 aside: a documented refusal (an objective that cannot be met,
  a full queue), counted by message; a serving group going down during the run (from /health) counts as a failure;
- mismatches: a status the document does not list for that operation, a Content-Type it does not list, or a body
  that does not match the listed schema (checks status_code_conformance, content_type_conformance,
  response_schema_conformance, response_headers_conformance);
- schema-valid cases refused (informational): requests drawn from the schemas (schemathesis's positive mode) answered
  400, by reason, which shows what the document cannot state (frontend/web/schema_constraints.py) or a drift;
- afterwards: the server's processes alive and unrestarted, and a greedy completion still served.

A table on stdout, everything in --json. Not part of CI (a few minutes; schemathesis is the optional extra `fuzz`:
`.venv/bin/pip install -e '.[fuzz]'`). Bounded by --max-examples per operation and phase, and by --timeout.

    .venv/bin/python scripts/dev/fuzz_schema.py
    .venv/bin/python scripts/dev/fuzz_schema.py --max-examples 100 --api-key sk-fuzz --json fuzz_schema.json
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.launcher.local_server import ShuttleServer, pid_alive  # noqa: E402

CONFORMANCE = ("status_code_conformance", "content_type_conformance", "response_schema_conformance",
               "response_headers_conformance")
CHECKS = ("not_a_server_error",) + CONFORMANCE
EXAMPLES_KEPT = 5  # per kind of failure, in the report


def run_schemathesis(url: str, args, report_dir: Path) -> int:
    """`schemathesis run` on url's /openapi.json, its NDJSON report written to report_dir; its exit status."""
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
               "--checks", ",".join(CHECKS), "--max-examples", str(args.max_examples), "--seed", str(args.seed),
               "--phases", args.phases, "--workers", str(args.workers), "--request-timeout", str(args.request_timeout),
               "--report", "ndjson", "--report-dir", str(report_dir), "--generation-database", "none",
               "--continue-on-failure", "--suppress-health-check", "all", "--no-color"]
    if args.api_key:
        command += ["-H", f"Authorization: Bearer {args.api_key}"]
    print("$", " ".join(command), flush=True)
    # (schemathesis's own --max-time would repeat fuzzing until the time is spent: a timeout bounds it instead)
    output = subprocess.run(command, cwd=report_dir, capture_output=True, text=True, timeout=args.timeout)
    Path(report_dir / "stdout.txt").write_text(output.stdout + output.stderr)
    return output.returncode


def _body(response: dict, limit: int = 300) -> str:
    content = response.get("content") or {}
    if isinstance(content, str):
        return content[:limit]
    if "$base64" in content:
        return base64.b64decode(content["$base64"]).decode("utf-8", "replace")[:limit]
    return str(content.get("string", ""))[:limit]


def summarize(ndjson: Path) -> dict:
    """Counts from schemathesis's NDJSON report: cases by operation and status, 5xx, failures by check."""
    cases, statuses = 0, defaultdict(Counter)
    failures: Counter = Counter()
    refused: Counter = Counter()  # schema-valid (positive) cases answered 400, by operation, param and message
    refusals: Counter = Counter()  # 503 answers by message
    examples: dict[str, list] = defaultdict(list)
    for line in ndjson.read_text().splitlines():
        event = json.loads(line)
        recorder = event.get("ScenarioFinished", {}).get("recorder")
        if not recorder:
            continue
        label = recorder.get("label", "?")
        interactions = recorder.get("interactions", {})
        for case_id, interaction in interactions.items():
            response = interaction.get("response") or {}
            request = interaction.get("request") or {}
            status = response.get("status_code", "no answer")
            operation = label if label != "Stateful tests" else f"{request.get('method')} {request.get('uri', '?')}"
            cases += 1
            statuses[label][str(status)] += 1
            meta = (recorder.get("cases", {}).get(case_id, {}).get("value") or {}).get("meta") or {}
            if status == 400 and (meta.get("generation") or {}).get("mode") == "positive":
                refused[_refusal(operation, response)] += 1
            if status == 503:
                refusals[_refusal(operation, response)[2]] += 1
            for check in recorder.get("checks", {}).get(case_id, []):
                if check.get("status") == "success" or (check["name"] == "not_a_server_error" and status == 503):
                    continue
                failures[check["name"]] += 1
                if len(examples[check["name"]]) < EXAMPLES_KEPT:
                    examples[check["name"]].append({
                        "operation": operation, "status": status, "request": request.get("method", "") + " " +
                        request.get("uri", ""), "body_sent": _body({"content": request.get("body")}),
                        "answer": _body(response),
                        "failure": str(((check.get("failure_info") or {}).get("failure") or {}).get("message"))[:500]})
    five_xx = sum(n for by_status in statuses.values() for s, n in by_status.items()
                  if s.isdigit() and int(s) >= 500 and s != "503")
    return {"cases": cases, "five_xx": five_xx, "refused_503": dict(refusals),
            "mismatches": sum(failures[c] for c in CONFORMANCE),
            "failures_by_check": dict(failures), "statuses": {k: dict(v) for k, v in sorted(statuses.items())},
            "schema_valid_refused": sum(refused.values()),
            "schema_valid_refused_by_reason": [[n, *reason] for reason, n in refused.most_common(20)],
            "examples": dict(examples)}


def _refusal(operation: str, response: dict) -> tuple[str, str, str]:
    try:
        error = json.loads(_body(response, 10_000))["error"]
    except (ValueError, KeyError, TypeError):
        return operation, "", "(not an OpenAI error)"
    return operation, str(error.get("param")), re.sub(r"\d+", "N", str(error.get("message")))[:100]


def times_down(url: str) -> int:
    """How often the server's serving groups have gone down since it started (from /health, an open path)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=60) as response:
            health = json.load(response)
    except urllib.error.HTTPError as exc:  # 503 while draining or restarting: the body is the same shape
        health = json.load(exc)
    return sum(group["times_down"] for group in health["groups"])


def server_still_serves(url: str, api_key: str | None) -> bool:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status == 200 and json.load(response)["usage"]["completion_tokens"] == 8


def table(report: dict) -> str:
    lines = [f"{'operation':<28} statuses (count)"]
    for operation, by_status in report["statuses"].items():
        lines.append(f"{operation:<28} " + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items())))
    lines += ["", f"cases        {report['cases']:>7}", f"5xx          {report['five_xx']:>7}  (503 aside)",
              f"503          {sum(report['refused_503'].values()):>7}  (documented refusals, with Retry-After: "
              f"{', '.join(report['refused_503']) or '-'})",
              f"mismatches   {report['mismatches']:>7}  (status, content type, body or headers not as documented)"]
    for check, n in sorted(report["failures_by_check"].items()):
        lines.append(f"  {check:<30} {n}")
    lines.append(f"schema-valid cases refused with 400 (constraints a schema cannot state): "
                 f"{report['schema_valid_refused']}")
    for n, operation, param, message in report["schema_valid_refused_by_reason"][:8]:
        lines.append(f"  {n:>5}  {operation} {param}: {message}")
    lines.append(f"engine down during the run: {report['engine_down_during_run']} time(s)")
    if "server" in report:
        server = report["server"]
        lines.append(f"server       restarts {server['restarts']}, processes alive {server['alive']}, "
                     f"greedy completion afterwards {'ok' if server['serves'] else 'FAILED'}")
    lines.append(f"run          {report['seconds']:.0f} s, schemathesis exit status {report['schemathesis_exit']}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--server-args",
                   default="--chat-template tests/data/stories_chat.jinja --max-waiting-requests 100000",
                   help="`shuttle serve` flags for the started server")
    p.add_argument("--api-key", default=None, help="start the server with this key and send it")
    p.add_argument("--max-examples", type=int, default=30, help="per operation and phase")
    p.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds, the whole schemathesis run at most")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="fuzz_schema.json", help="where to write the full report")
    p.add_argument("--keep-report", help="a directory to keep schemathesis's own NDJSON report and output in")
    args = p.parse_args()

    started = time.monotonic()
    server = None
    if args.url is None:
        env = {"SHUTTLE_API_KEY": args.api_key} if args.api_key else None
        server = ShuttleServer(*args.server_args.split(), env=env)
    url = args.url or server.url
    try:
        with tempfile.TemporaryDirectory(prefix="shuttle-fuzz-schema-") as scratch:
            report_dir = Path(args.keep_report or scratch)
            report_dir.mkdir(parents=True, exist_ok=True)
            down_before = times_down(url)
            exit_status = run_schemathesis(url, args, report_dir.resolve())
            report_down = times_down(url) - down_before
            [ndjson] = report_dir.glob("*.ndjson")
            report = summarize(ndjson)
            report["schemathesis_output_tail"] = (report_dir / "stdout.txt").read_text()[-3000:]
        report["schemathesis_exit"] = exit_status
        report["engine_down_during_run"] = report_down
        serves = server_still_serves(url, args.api_key)
        if server is not None:
            report["server"] = {"restarts": server.restarts, "alive": all(pid_alive(pid) for pid in server.all_pids),
                                "serves": serves}
    finally:
        if server is not None:
            server.stop()
    report["seconds"] = time.monotonic() - started
    report["command"] = sys.argv
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))
    for check, found in report["examples"].items():
        print(f"  e.g. {check}: {json.dumps(found[0])[:600]}")
    print(f"full report: {args.json}")
    healthy = report.get("server", {"restarts": 0, "alive": True})
    ok = (report["five_xx"] == 0 and report["mismatches"] == 0 and serves and healthy["restarts"] == 0
          and healthy["alive"] and report["engine_down_during_run"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
