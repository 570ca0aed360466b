"""Print the JSON-schema keyword table of docs/structured-outputs.md from frontend/structured/schema_support.py's
KEYWORDS (tests/unit/test_schema_support.py checks each row against the grammar engine and that the docs hold this
output).

    .venv/bin/python scripts/dev/schema_keyword_table.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.frontend.structured.schema_support import ANNOTATION, ENFORCED, KEYWORDS, REFUSED  # noqa: E402


def main() -> None:
    print("| keyword | what the engine does | when, or why |")
    print("|---|---|---|")
    for fate in (ENFORCED, REFUSED, ANNOTATION):
        for keyword, (kind, note) in KEYWORDS.items():
            if kind == fate:
                print(f"| `{keyword}` | {fate} | {note} |")


if __name__ == "__main__":
    main()
