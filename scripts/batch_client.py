#!/usr/bin/env python3
"""Run a JSONL file of completion jobs through shuttle's ZeroMQ batch endpoint; write one JSON result per line.

Each input line holds BatchJob fields: {"prompt": "...", "max_tokens": 32, "temperature": 0, ...} (job_id optional).

    .venv/bin/python scripts/batch_client.py jobs.jsonl results.jsonl --endpoint tcp://127.0.0.1:8001
"""

import argparse
import json
import sys
from pathlib import Path

import msgspec
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.batch_client import BatchClient  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:8001")
    parser.add_argument("--window", type=int, default=64, help="jobs in flight at once")
    parser.add_argument("--api-key", default=None, help="the server's API key (default: $SHUTTLE_API_KEY)")
    args = parser.parse_args()
    jobs = [json.loads(line) for line in args.jobs.read_text().splitlines() if line.strip()]
    failed = 0
    with BatchClient(args.endpoint, args.window, api_key=args.api_key) as client, args.results.open("w") as out:
        for result in tqdm(client.run(jobs), total=len(jobs), desc="jobs"):
            failed += bool(result.error_status)
            out.write(json.dumps(msgspec.structs.asdict(result), ensure_ascii=False) + "\n")
    print(f"{len(jobs) - failed} done, {failed} failed -> {args.results}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
