"""Text from the disk as a piece of one printed line: the one escaping rule of every command's
output, and the one way a line names a snapshot file, below the core so the core (audit's lines,
the mirror's -v lines) and the CLI share them."""

from __future__ import annotations


def printable(text: str) -> str:
    """One problem, one line: a newline or a non-UTF-8 byte in a NAS file name is shown escaped
    (`\\n`, `\\udcff` for byte 0xff) instead of breaking the line or the terminal."""
    return text if text.isprintable() else repr(text)[1:-1]


def known_as(name: str, blob: str | None) -> str:
    """A snapshot file as lines name it: its snapshot name (hub.snapshot_name), then its blob if it
    has one: `acme/Flash-3bpw@c24c615/model-00003-of-00017.safetensors blob 8af272e3...`."""
    return f"{name} blob {blob}" if blob else name
