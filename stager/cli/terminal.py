"""Output: JSON on stdout, human text and progress on stderr."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from typing import Callable

import typer

from stager.errors import EXIT_OK, EXIT_PROBLEMS
from stager.units import format_size


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def say(text: str) -> None:
    typer.echo(text, err=True)


def exit_with(problems: list) -> None:
    raise typer.Exit(EXIT_PROBLEMS if problems else EXIT_OK)


def byte_progress(enabled: bool, desc: str) -> Callable[[int], Callable[[int], None]] | None:
    """A tqdm bar in bytes with rate and ETA, only on a terminal and never with --json."""
    if not enabled or not sys.stderr.isatty():
        return None

    def factory(total: int) -> Callable[[int], None]:
        from tqdm import tqdm

        # A fresh pty (ssh -t, a launcher's pty) can report a 0x0 size; tqdm then draws nothing.
        columns, lines = shutil.get_terminal_size((100, 20))
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                   ncols=columns or 100, nrows=lines or 20, leave=True)
        lock = threading.Lock()

        def update(n: int) -> None:
            with lock:
                bar.update(n)
                if bar.n >= bar.total:
                    bar.close()

        return update

    return factory


def print_problems(problems: list) -> None:
    for problem in problems:
        say(f"  {problem.kind:<16} {printable(problem.path)}: {printable(problem.detail)}")


def printable(text: str) -> str:
    """One problem, one line: a newline or a non-UTF-8 byte in a NAS file name is shown escaped
    (`\\n`, `\\udcff` for byte 0xff) instead of breaking the line or the terminal."""
    return text if text.isprintable() else repr(text)[1:-1]


def size(n: int) -> str:
    return format_size(n)
