#!/usr/bin/env python3
"""Start a serving group without installing the console script: `python scripts/launch.py serve [MODEL_DIR] ...`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
