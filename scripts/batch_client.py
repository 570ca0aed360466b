#!/usr/bin/env python3
"""`shuttle batch` for a checkout without the `shuttle` command installed: an OpenAI batch file (JSONL) through a
server's ZeroMQ batch endpoint (see batch_jobs/batch_file.py).

    .venv/bin/python scripts/batch_client.py INPUT.jsonl OUTPUT.jsonl --endpoint tcp://127.0.0.1:8001
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
