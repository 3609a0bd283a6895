"""Generated blocks in the docs (the settings table, the patch table): replace what lies between two markers, and
write the document or, with ``--check``, fail when the committed block is stale."""

from __future__ import annotations

import sys
from pathlib import Path


def replace_block(text: str, begin: str, end: str, body: str, what: str) -> str:
    """``text`` with the block between the markers ``begin`` and ``end`` replaced by ``body``."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{what} lacks its table markers")
    return text[: start + len(begin)] + "\n" + body + "\n" + text[stop:]


def write_or_check(doc: Path, old: str, new: str, *, check: bool, stale: str) -> int:
    """Exit status of a generator: with ``check`` 1 (printing ``stale``) when ``new`` differs from ``old``, else 0;
    without it, ``doc`` is written."""
    if check:
        if new != old:
            print(f"error: {stale}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(new)
    return 0
