"""Which product functions one streamed n=1 chat request enters, in each of the server's processes.

Usage: python scripts/dev/trace_request.py [--json OUT]

Starts `shuttle serve` on the default model with a sitecustomize that installs a profile hook in every thread of
every process (frontend, scheduler, worker). After one warm-up request, tracing is switched on (a file appears),
one streamed chat request with n=1 and max_tokens=8 runs to its end, tracing is switched off, and each process
writes the distinct functions (file, qualified name) that were entered from the repository's product packages.
Idle polling in the same window counts too: the figure is what serving one request touches, not a call count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# stories260K has no chat template of its own
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

SITECUSTOMIZE = '''
import os, sys, threading, json, atexit
_ROOT = os.environ["TRACE_ROOT"]
_DIR = os.environ["TRACE_DIR"]
_SKIP = (os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "scripts"), os.path.join(_ROOT, ".venv"))
_seen = set()
_on = False
def _hook(frame, event, arg):
    if _on and event == "call":
        f = frame.f_code.co_filename
        if f.startswith(_ROOT) and not f.startswith(_SKIP):
            _seen.add((os.path.relpath(f, _ROOT), frame.f_code.co_qualname))
def _watch():
    global _on
    import time
    flag = os.path.join(_DIR, "on")
    while True:
        now = os.path.exists(flag)
        if _on and not now:
            _on = False
            with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as out:
                json.dump({"argv": sys.argv, "functions": sorted(_seen)}, out)
        _on = now
        time.sleep(0.01)
sys.setprofile(_hook)
threading.setprofile(_hook)
threading.Thread(target=_watch, daemon=True).start()
'''


def chat(url: str) -> None:
    body = json.dumps({"model": "stories260K", "stream": True, "n": 1, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Once upon a time"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    assert "[DONE]" in text, text[-300:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from shuttle.launcher.local_server import ShuttleServer
    with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as trace:
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {"PYTHONPATH": site, "TRACE_ROOT": str(ROOT), "TRACE_DIR": trace}
        with ShuttleServer("--batch-endpoint", "none", "--chat-template", CHAT_TEMPLATE, env=env, cwd=ROOT) as server:
            chat(server.url)
            Path(trace, "on").touch()
            time.sleep(0.2)
            chat(server.url)
            Path(trace, "on").unlink()
            deadline = time.monotonic() + 20
            while len(list(Path(trace).glob("*.json"))) < len(server.all_pids) and time.monotonic() < deadline:
                time.sleep(0.1)
        report = {}
        for dump in Path(trace).glob("*.json"):
            data = json.loads(dump.read_text())
            report[Path(data["argv"][0]).parent.name] = data["functions"]
    total = sum(len(f) for f in report.values())
    files = Counter(path for functions in report.values() for path, _ in functions)
    print(f"{'process':<24} {'functions':>9} {'files':>6}")
    for role, functions in sorted(report.items()):
        print(f"{role:<24} {len(functions):>9} {len({p for p, _ in functions}):>6}")
    print(f"{'total':<24} {total:>9} {len(files):>6}")
    if args.json:
        args.json.write_text(json.dumps({"processes": report, "files": dict(files)}, indent=1))


if __name__ == "__main__":
    main()
