"""Regenerate the docs' generated sections from the code: `make docs`.

docs/config.md's identity table (between `<!-- identity-table -->` markers) is goodput.identity's
TABLE; tests/unit/test_identity.py fails when the page and the code differ.
"""

import re
import sys
from pathlib import Path

from goodput import identity

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
SECTION = re.compile(r"(<!-- identity-table -->\n)(.*?)(\n<!-- /identity-table -->)", re.S)


def main() -> int:
    text = PAGE.read_text()
    if not SECTION.search(text):
        print(f"gen_docs.py: {PAGE} has no <!-- identity-table --> section", file=sys.stderr)
        return 2
    new = SECTION.sub(lambda m: m.group(1) + identity.markdown_table() + m.group(3), text)
    if new != text:
        PAGE.write_text(new)
        print(f"rewrote the identity table in {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
