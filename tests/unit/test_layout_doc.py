"""docs/layout.md against the tree: every module of the product packages and scripts/ is named under its directory's
heading, every directory of them has a heading, every test layer has one, and nothing named is missing from disk."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("shuttle", "common", "launcher", "batch_jobs", "frontend", "scheduler", "worker", "capacity",
           "offline", "scripts")
IGNORED_DIRS = {"__pycache__", "static"}


def _documented() -> dict[str, set[str]]:
    """heading directory -> file names bulleted under it."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in (REPO / "docs" / "layout.md").read_text().splitlines():
        if heading := re.match(r"## (\S+)/$", line):
            current = sections.setdefault(heading.group(1), set())
        elif line.startswith("## "):  # a section that is no directory of modules
            current = None
        elif (bullet := re.match(r"- `([^`/]+)`", line)) and current is not None:
            current.add(bullet.group(1))
    return sections


def _on_disk() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in PRODUCT:
        for directory in [REPO / top, *(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            if IGNORED_DIRS & set(directory.relative_to(REPO).parts):
                continue
            names = {f.name for f in directory.iterdir() if f.suffix in (".py", ".sh")}
            names -= set() if top == "shuttle" else {"__init__.py"}
            found[str(directory.relative_to(REPO))] = names
    found["tests"] = {f.name for f in (REPO / "tests").glob("*.py")} - {"__init__.py"}
    for layer in (REPO / "tests").iterdir():
        if layer.is_dir() and (layer / "__init__.py").is_file():
            found[f"tests/{layer.name}"] = set()  # a layer's heading says what it holds; its files are not listed
    return found


def test_every_module_is_on_the_layout_page_and_nothing_else():
    documented, on_disk = _documented(), _on_disk()
    assert sorted(documented) == sorted(on_disk), "headings differ from the directories"
    for directory, names in on_disk.items():
        listed = documented[directory]
        assert listed == names, f"{directory}/: layout.md lists {sorted(listed - names)} that do not exist and " \
                                f"misses {sorted(names - listed)}"


def test_frontend_keeps_at_most_15_modules_at_its_top():
    assert len(list((REPO / "frontend").glob("*.py"))) <= 15
