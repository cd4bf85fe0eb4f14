"""Output: the result on stdout (the text report, or one JSON object), everything else on stderr.

`| grep`, `| less` and `| jq` read stdout; logs, notes and progress go to stderr, where they never
mix into a result. A reader that closes the pipe early (`| head -1`) ends the output, not the run:
the rest is discarded and the command still exits with its own code (see `_write`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
from typing import Callable, Iterator

import typer

from stager.base import progress_pipe
from stager.base.errors import EXIT_OK, EXIT_PROBLEMS
from stager.base.text import known_as, printable
from stager.base.units import format_size

_json_emitted = False
_live: "LiveLines | None" = None  # the lines being redrawn on stderr, while there are

# How much goes to stderr beside the result (docs/design.md §7, "Verbosity"):
# -1 (-q) errors only; 0 progress on a terminal and notes; 1 (-v) a line per file acted on, in
# place of the progress bar; 2 (-vv) debug detail too. stdout, errors and exit codes never change.
QUIET, NORMAL, VERBOSE, DEBUG = -1, 0, 1, 2
_level = NORMAL


def set_verbosity(level: int) -> None:
    """The level for this run; the core's log lines (logger "stager") go to stderr from -v on."""
    import logging

    global _level
    _level = max(QUIET, min(DEBUG, level))
    logger = logging.getLogger("stager")
    logger.handlers[:] = [_stderr_lines_handler()]
    logger.propagate = False
    logger.setLevel(logging.DEBUG if _level >= DEBUG else logging.INFO if _level >= VERBOSE else logging.WARNING)


def verbosity() -> int:
    return _level


def emit_json(obj: dict) -> None:
    """The one JSON object of a `--json` run, on stdout."""
    global _json_emitted
    _json_emitted = True
    _write(sys.stdout, json.dumps(obj, sort_keys=False) + "\n")


def emitted_json() -> bool:
    return _json_emitted


def report(text: str) -> None:
    """A line of the result, on stdout."""
    _write(sys.stdout, text + "\n")


def say(text: str) -> None:
    """A line for the operator that is not the result (a note, a log line, an error), on stderr;
    above the live lines while they are drawn."""
    if _live is not None:
        _live.above(text + "\n")
    else:
        _write(sys.stderr, text + "\n")


def note(text: str) -> None:
    """An informational line on stderr (a note, a summary beside machine output); not with -q."""
    if _level > QUIET:
        say(text)


def _stderr_lines_handler():
    import logging

    class StderrLines(logging.Handler):
        """A log record as one printable stderr line, through the same closed-pipe-safe writer:
        logging's own StreamHandler printed a traceback ("--- Logging error ---") on a closed stderr."""

        def emit(self, record) -> None:
            try:
                say(printable(record.getMessage()))
            except OSError:
                pass

    return StderrLines()


def close_stdout() -> None:
    """Flush stdout before exit, so a closed pipe is met here and not in the interpreter's shutdown
    (which printed "Exception ignored ... BrokenPipeError" and exited 120)."""
    try:
        _write(sys.stdout, "")
    except OSError:  # stdout closed outright (`>&-`): nothing was ever going to be read
        pass


def _write(stream, text: str) -> None:
    # A closed pipe is the reader saying "enough": the rest of the output goes to /dev/null and
    # the command carries on to its own exit code. typer exited 1 ("problems found") instead.
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        discard(stream)


def discard(stream) -> None:
    """Point `stream` at /dev/null: its reader is gone, and later writes and the final flush succeed."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    finally:
        os.close(null)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """"1 problem", "2 problems", "1 entry", "9 entries"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def exit_with(problems: list) -> None:
    raise typer.Exit(EXIT_PROBLEMS if problems else EXIT_OK)


def byte_progress(enabled: bool, desc: str) -> Callable[[int], Callable[[int], None]] | None:
    """A tqdm bar in bytes with rate and ETA, only on a terminal, never with --json or -q, and not
    with -v, whose line per file would tear the bar. Run by `stage fleet` as a node's task, the
    counts go to the task instead (base/progress_pipe.py), --json and all."""
    piped = progress_pipe.from_environment()
    if piped is not None:
        return piped
    if not enabled or _level != NORMAL or not sys.stderr.isatty():
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


class LiveLines:
    """A line per node on stderr, redrawn in place as `docker pull` draws its layers: the cursor
    goes back up over the block drawn last, and the block is written again. Each line is cut to
    the terminal's width, so that none wraps (a wrapped line would throw the count of lines to go
    back over off). Another stderr line of this process (`say`) is written where the block was,
    and the block drawn again under it. Called with the new lines; they stay on the screen."""

    def __init__(self):
        self.lines: list[str] = []
        self.drawn = 0
        self.lock = threading.Lock()

    def __call__(self, lines: list[str]) -> None:
        with self.lock:
            self.lines = list(lines)
            self._draw("")

    def above(self, text: str) -> None:
        with self.lock:
            self._draw(text)

    def _draw(self, above: str) -> None:
        width = max(20, shutil.get_terminal_size((100, 20)).columns or 100) - 1
        back = f"\x1b[{self.drawn}A\r\x1b[J" if self.drawn else ""
        self.drawn = len(self.lines)
        _write(sys.stderr, back + above + "".join(printable(line)[:width] + "\n" for line in self.lines))


@contextlib.contextmanager
def live_lines(enabled: bool) -> Iterator[LiveLines | None]:
    """Lines redrawn in place on stderr, only on a terminal, never with --json (`enabled` False)
    or -q: elsewhere (a pipe, a log file) redrawn lines are noise, and None is yielded."""
    global _live
    if not enabled or _level < NORMAL or not sys.stderr.isatty():
        yield None
        return
    _live = LiveLines()
    try:
        yield _live
    finally:
        _live = None


def print_problems(problems: list, *, to_stdout: bool = False) -> None:
    """One line per problem: kind, path, detail. Part of the result for commands whose report is
    text (`to_stdout`); a note beside it for those whose stdout is machine input (binds). A
    problem with a snapshot file leads with the names people know it by, its path at the end."""
    for problem in problems:
        if getattr(problem, "name", None):
            line = f"{known_as(problem.name, problem.blob)}: {problem.detail} ({problem.path})"
        else:
            line = f"{problem.path}: {problem.detail}"
        (report if to_stdout else say)(f"  {problem.kind:<16} {printable(line)}")


def print_pending(pending: list) -> None:
    """One line per NAS revision still downloading, part of the result: which revision is pending
    and which one the node stays on (hub.Pending). Not a problem: the exit code stays 0."""
    for item in pending:
        report(f"  {'pending':<16} {printable(item.describe())}")


def size(n: int) -> str:
    return format_size(n)
