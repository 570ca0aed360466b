"""shuttle: an LLM serving engine (continuous batching, chunked prefill, a paged KV cache) behind an OpenAI-compatible
API.

The wheel installs the project's packages under this one name: `shuttle.frontend`, `shuttle.scheduler`,
`shuttle.worker`, `shuttle.common`, `shuttle.launcher`, `shuttle.capacity` and `shuttle.batch_jobs`
(pyproject.toml's package-dir maps them from the repository root, where they live side by side).

Run from a source tree (the repository root on sys.path, no install), this directory holds only this file, so the
root itself is added to the package's search path: `import shuttle.frontend` then finds the repository's frontend/.
An installed shuttle has its sub-packages in this directory and never looks further.
"""

from __future__ import annotations

from pathlib import Path

from shuttle.common.version import shuttle_version

_HERE = Path(__file__).resolve().parent
if not (_HERE / "common").is_dir() and (_HERE.parent / "common" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 (the package's own __path__)

__version__ = shuttle_version()

# vLLM's offline API (offline/), imported on first use: `import shuttle` stays light (no torch, no model code)
_OFFLINE = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt")

__all__ = ["__version__", *_OFFLINE]


def __getattr__(name: str):
    if name in _OFFLINE:
        from shuttle import offline
        return getattr(offline, name)
    raise AttributeError(f"module 'shuttle' has no attribute {name!r}")
