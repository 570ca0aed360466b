"""Size of the product code: files and lines per package, files over 300 lines, functions over 60 lines.

Usage: python scripts/dev/code_stats.py [--json OUT]

Counts physical lines of the product packages (not tests/, scripts/ or docs/). A function's length is from its `def`
line to its last line (ast's end_lineno), decorators excluded; nested functions count on their own too.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("frontend", "scheduler", "worker", "common", "launcher", "capacity", "batch_jobs", "offline", "shuttle")
LONG_FILE_LINES = 300
LONG_FUNCTION_LINES = 60


def product_files() -> dict[str, list[Path]]:
    """Every product .py file, by top-level package (directories that exist only)."""
    return {p: sorted((ROOT / p).rglob("*.py")) for p in PACKAGES if (ROOT / p).is_dir()}


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in `path` longer than LONG_FUNCTION_LINES."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > LONG_FUNCTION_LINES:
                        found.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    packages = product_files()
    report: dict = {"packages": {}, "long_files": [], "long_functions": []}
    for package, files in packages.items():
        lines = 0
        for f in files:
            n = len(f.read_text().splitlines())
            lines += n
            rel = str(f.relative_to(ROOT))
            if n > LONG_FILE_LINES:
                report["long_files"].append((rel, n))
            report["long_functions"] += [(f"{rel}:{name}", n) for name, n in long_functions(f)]
        report["packages"][package] = {"files": len(files), "lines": lines}
    print(f"{'package':<12} {'files':>6} {'lines':>7}")
    for package, row in report["packages"].items():
        print(f"{package:<12} {row['files']:>6} {row['lines']:>7}")
    total_files = sum(r["files"] for r in report["packages"].values())
    total_lines = sum(r["lines"] for r in report["packages"].values())
    print(f"{'total':<12} {total_files:>6} {total_lines:>7}")
    print(f"\nfiles over {LONG_FILE_LINES} lines: {len(report['long_files'])}")
    for rel, n in sorted(report["long_files"], key=lambda r: -r[1]):
        print(f"  {n:>5}  {rel}")
    print(f"\nfunctions over {LONG_FUNCTION_LINES} lines: {len(report['long_functions'])}")
    for name, n in sorted(report["long_functions"], key=lambda r: -r[1]):
        print(f"  {n:>5}  {name}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
