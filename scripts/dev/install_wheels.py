#!/usr/bin/env python3
"""Install the carried wheels (scripts/gpu_wheels.sh) whose distribution this interpreter lacks, into a --target
folder to put on PYTHONPATH; the packages it already has (torch, transformers, ...) stay as they are.

    python3 scripts/dev/install_wheels.py .gpu_carry/wheels /tmp/shuttle-gpu-site
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path


def main() -> int:
    wheels, site = Path(sys.argv[1]), sys.argv[2]
    if not wheels.is_dir():
        print(f"{wheels} is missing: run scripts/gpu_wheels.sh where PyPI is reachable, and carry .gpu_carry")
        return 1
    missing = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            print(f"  have {name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    if not missing:
        print("  nothing to install")
        return 0
    print("  installing " + ", ".join(w.name for w in missing))
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--disable-pip-version-check", "--upgrade", "--target", site, *map(str, missing)]).returncode


if __name__ == "__main__":
    sys.exit(main())
