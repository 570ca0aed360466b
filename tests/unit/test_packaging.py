"""pyproject.toml installs every product package, and each under the one name `shuttle`."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_installed_under_shuttle():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    assert all(name == "shuttle" or name.startswith("shuttle.") for name in setuptools["packages"])
    on_disk = set()
    for name, directory in mapping.items():
        root = REPO / directory
        for sub in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            if any(sub.glob("*.py")) or any(sub.glob("*.html")):
                on_disk.add(".".join([name, *sub.relative_to(root).parts]))
    assert set(setuptools["packages"]) == on_disk
    assert all((REPO / directory / "__init__.py").is_file() for directory in mapping.values())
