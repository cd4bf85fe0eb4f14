"""Text from the disk as a piece of one printed line: the one escaping rule of every command's
output, below the core so the core (audit's lines) and the CLI share it."""

from __future__ import annotations


def printable(text: str) -> str:
    """One problem, one line: a newline or a non-UTF-8 byte in a NAS file name is shown escaped
    (`\\n`, `\\udcff` for byte 0xff) instead of breaking the line or the terminal."""
    return text if text.isprintable() else repr(text)[1:-1]
