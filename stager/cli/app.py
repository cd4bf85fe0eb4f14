"""The typer app, the options every command shares, and the one place that ends a command.

How a command ends is the contract operators script against (docs/design.md §7):
0 clean, 1 problems found, 2 bad input or usage, 3 could not run, 130 interrupted (SIGINT),
143 terminated (SIGTERM), and a closed stdout never turns into 1. The result goes to stdout,
everything else to stderr, and with `--json` stdout holds exactly one JSON object, an error
included. `main()` enforces all of it, so the commands only parse, call the core and report.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, Optional

import typer

from stager.base import hints, interrupts
from stager.cli import completion
from stager.base.errors import EXIT_BAD_INPUT, BadInput, StageError, ending
from stager.manifest import MAX_TP  # the manifest's bound on world, ranks and layers

_HELP_NAMES = ["-h", "--help"]

_APP_SETTINGS = dict(
    name="stage",
    help="Stage model weights and Engram row shards onto node-local NVMe, verified.",
    no_args_is_help=True,
    add_completion=False,  # completion.py's two options instead: --show-completion takes the shell
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts show "[default: ...]" literally
    context_settings={"help_option_names": _HELP_NAMES},  # inherited by every subcommand
)
app = typer.Typer(**_APP_SETTINGS)


def _remember_manifest(value: Optional[str]) -> Optional[str]:
    hints.use_manifest(value)  # every printed repair command then carries the same --manifest
    return value


ManifestOpt = Annotated[
    Optional[str],
    typer.Option("--manifest", "-m", metavar="PATH", callback=_remember_manifest,
                 help="Manifest path [default: $STAGE_MANIFEST or manifests/cluster.toml]"),
]
# `--node` has no short form: `-n` is a dry run, as in rsync and rclone, so an old `-n NAME` fails
# with exit 2 (an unexpected argument, or no such option) instead of naming a node.
NodeOpt = Annotated[str, typer.Option("--node", metavar="NAME", help="Node name from the manifest's [nodes] table")]
OptionalNodeOpt = Annotated[Optional[str], typer.Option("--node", metavar="NAME",
                                                        help="Node name from the manifest's [nodes] table")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="List what would be done and why; change nothing")]
# Every command takes both (tests/cli/test_cli_contract.py checks): the level is read from the parsed
# command line before the command runs (see _shell_contract), so the commands never see them.
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", expose_value=False,
                                        help="Only the result and errors: no progress bar, no notes")]
VerboseOpt = Annotated[int, typer.Option("--verbose", "-v", count=True, expose_value=False, show_default=False,
                                         help="A stderr line per file acted on; -vv adds debug detail")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout, errors included")]
FullOpt = Annotated[bool, typer.Option("--full", help="Hash every byte against the strongest reference")]
# Every numeric option is one of these aliases and has a range: `_plain_conversions` refuses a value
# that is not a finite number inside it (exit 2, naming the option). `--wait nan` and `--wait inf`
# passed `min=0` (NaN compares false to everything) and waited for ever.
MAX_WAIT_SECONDS = 86_400  # a day: a wait longer than that is a mistake, not patience
MAX_TIMEOUT_SECONDS = 7 * 86_400  # a week: a fleet mirror of many TB over a slow NAS still fits
MAX_SEED = 2**32 - 1  # the range of the random seed a report shows


def check_rate(value: Optional[str]) -> Optional[str]:
    """A --bwlimit value refused at parse time (exit 2, naming the option), kept as the operator spelled it."""
    if value is not None:
        from stager.base.units import parse_rate

        try:
            parse_rate(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


BwlimitOpt = Annotated[Optional[str], typer.Option(
    "--bwlimit", metavar="RATE", callback=check_rate,
    help="Read at most RATE from the NAS (and any --source), all parallel reads together: "
         "KiB/s, or 50M = 50 MiB/s, 50MB = 50 MB/s; 0 or off: no limit (docs/operations.md)")]
JobsOpt = Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, max=64, metavar="N",
                                                help="Files copied or checked in parallel (1-64)")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", metavar="N", min=0, max=MAX_SEED,
                                                help="Seed for the sampled regions [default: random, reported]")]
WaitOpt = Annotated[float, typer.Option(
    "--wait", metavar="SECONDS", min=0, max=MAX_WAIT_SECONDS,
    help="When another stage process holds the node hub, wait up to SECONDS for it "
         "instead of exiting 3 at once")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", metavar="SECONDS", min=1, max=MAX_TIMEOUT_SECONDS,
    help="Seconds before a silent node is reported unreachable")]
RankOpt = Annotated[Optional[list[int]], typer.Option(
    "--rank", "-r", min=0, max=MAX_TP - 1,
    help="TP rank (repeatable) [default: nodes.X.ranks or nodes.X.rank, else every rank]")]
WorldOpt = Annotated[Optional[int], typer.Option("--world", min=1, max=MAX_TP, help="TP size [default: engram.world]")]
LayerOpt = Annotated[Optional[list[int]], typer.Option("--layer", min=0, max=MAX_TP - 1,
                                                       help="Only this layer (repeatable)")]


def _print_version(value: bool) -> None:
    if value:
        from stager import __version__

        typer.echo(f"stage {__version__}")
        raise typer.Exit()


@app.callback()
def _stage(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit")] = False,
    install_completion: Annotated[bool, typer.Option(
        "--install-completion", callback=completion.install, is_eager=True, expose_value=False,
        help="Install completion for the shell running stage (bash, zsh, fish)")] = False,
    show_completion: Annotated[Optional[str], typer.Option(
        "--show-completion", metavar="SHELL", callback=completion.show, is_eager=True, expose_value=False,
        autocompletion=completion.shells,
        help="Print the completion script for SHELL (bash, zsh, fish), to install it by hand")] = None,
) -> None:
    """Stage model weights and Engram row shards onto node-local NVMe, verified."""


class Signalled(BaseException):
    """SIGINT or SIGTERM, raised in the main thread so that every `finally` and `with` on the way
    out runs: temp files are discarded and locks released before the process ends.

    A BaseException of its own, not KeyboardInterrupt: typer turned KeyboardInterrupt into a
    silent exit 130, and click's Abort into "Aborted!" with exit 1, before this module saw it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.message = "interrupted" if signum == signal.SIGINT else "terminated"


def _on_signal(signum: int, _frame) -> None:
    if interrupts.held_back(signum):  # raised again as the block ends (see stager.base.interrupts)
        return
    # A second signal while the first one's clean-up runs ends the process the default way.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signalled = Signalled(signum)
    _announce(signalled)
    raise signalled


def _singular(noun: str) -> str:
    return noun[:-3] + "y" if noun.endswith("ies") else noun.removesuffix("s")


def _announce(signalled: Signalled) -> None:
    """The run's one stderr line, at once: a Ctrl-C with copies in flight was silent for as long
    as they took. Written straight to the descriptor: the signal may have arrived in the middle of
    a write to sys.stderr, which a second write through the same buffer would refuse."""
    # Nothing is imported here: the signal may land while a module is being imported, and an
    # import from the handler then found it half-initialised (AttributeError: partially
    # initialized module 'logging'), which took the signal's place: exit 3, not 143. Without the
    # workers module loaded, nothing is in flight.
    workers = sys.modules.get("stager.base.workers")
    flying = workers.in_flight() if workers is not None else {}
    busy = ", ".join(f"{n} {noun if n != 1 else _singular(noun)}" for noun, n in sorted(flying.items()))
    line = f"stage: {signalled.message}" + (f", stopping {busy} in flight..." if busy else "")
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def main() -> None:
    """Entry point: run the command and turn however it ended into its documented exit code."""
    argv = sys.argv[1:]
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    code, line, error = _run(argv)
    # The work is over, clean-up included: a signal from here on just ends the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from stager.cli import terminal

    if line is not None:
        terminal.say(f"stage: {line}")
    if error is not None and _wants_json(argv) and not terminal.emitted_json():
        terminal.emit_json({"error": error, "exit_code": code})
    terminal.close_stdout()
    sys.exit(code)


def _run(argv: list[str]) -> tuple[int, str | None, str | None]:
    """(exit code, the one line for stderr, the error for a --json object) of running the command."""
    try:
        completion.serve_requests()
        command = typer.main.get_command(_app_for(argv))
        _word_placeholders(command)
        _plain_conversions(command)
        for sub in _commands(command):
            _shell_contract(sub)
        result = command.main(args=argv, prog_name="stage", standalone_mode=False)
        return (result if isinstance(result, int) else 0), None, None
    except Signalled as exc:  # its line is on stderr already (see _announce)
        return exc.exit_code, None, exc.message
    except typer.Abort:  # click's own reading of Ctrl-C (at a prompt, say)
        return 128 + signal.SIGINT, "interrupted", "interrupted"
    except typer.TyperException as exc:  # usage: unknown option, missing --node, ...
        if not hasattr(exc, "show"):
            return EXIT_BAD_INPUT, f"error: {exc.format_message()}", exc.format_message()
        try:
            exc.show()  # "Usage: ... Try 'stage X -h' for help. Error: ..." on stderr
        except BrokenPipeError:
            from stager.cli import terminal

            terminal.discard(sys.stderr)
        return EXIT_BAD_INPUT, None, exc.format_message()
    except (StageError, OSError) as exc:  # an OSError not mapped by the core names its path
        code, message = ending(exc)
        message = _naming_the_default_manifest(message)
        return code, f"error: {message}", message
    except SystemExit as exc:
        if _stdout_closed_under_typer():
            return 128 + signal.SIGPIPE, None, None
        return (exc.code if isinstance(exc.code, int) else 1), None, None
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if os.environ.get("STAGE_DEBUG"):
            raise
        code, message = ending(exc)
        return code, message, message


def _naming_the_default_manifest(message: str) -> str:
    """`message`, plus the manifest it ran with when no --manifest or $STAGE_MANIFEST chose one."""
    manifest = sys.modules.get("stager.manifest")  # not imported: no manifest was read
    default = manifest.default_in_use() if manifest else None
    if default is None or str(default) in message:
        return message
    return f"{message} (manifest: {default}, the default: no --manifest or ${hints.MANIFEST_ENV})"


def _app_for(argv: list[str]) -> typer.Typer:
    """The app, narrowed to the one command that argv names.

    typer builds every command's click parameters from its signature (resolving the annotations
    of all of them) before it looks at argv: a third of a warm no-op `stage verify`. A command
    named first needs only itself; its usage line, help and errors are the same as in the full
    app; so is a group's (`fleet`) with its own commands. Anything else (no command, an option
    first) gets the full app."""
    named = {info.name or typer.main.get_command_name(info.callback.__name__): info
             for info in app.registered_commands}
    groups = {info.name: info for info in app.registered_groups}
    if not argv or argv[0] not in {*named, *groups}:
        return app
    narrow = typer.Typer(**_APP_SETTINGS)
    narrow.registered_callback = app.registered_callback
    narrow.registered_commands = [named[argv[0]]] if argv[0] in named else []
    narrow.registered_groups = [groups[argv[0]]] if argv[0] in groups else []
    return narrow


def _wants_json(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--":
            return False
        if arg == "--json" or arg == "--format=json" or (arg == "--format" and argv[i + 1:i + 2] == ["json"]):
            return True
    return False


def _stdout_closed_under_typer() -> bool:
    """typer answers a BrokenPipeError it sees with sys.exit(1) ("problems found") after wrapping
    stdout in click's PacifyFlushWrapper; that wrapper is how the closed pipe is recognised."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _commands(command) -> list:
    """Every command below the app, groups' commands included."""
    found = []
    for sub in getattr(command, "commands", {}).values():
        found.append(sub)
        found.extend(_commands(sub))
    return found


def _shell_contract(command) -> None:
    """What every command has, present and future, without each one repeating it: a refusal of a
    repeated single-valued option, `-q`/`-v` read before it runs, and its whole description in
    `stage -h`."""
    # click cuts a command's description at 45 characters with "..." in the group's list.
    if command.help and not command.short_help:
        command.short_help = " ".join(command.help.split("\n\n")[0].split())
    parse = command.parse_args

    def parse_args(ctx, args):
        # click keeps the last of `--node a --node b` without a word; and the level is needed
        # before the command runs. One parse more of a short argv costs microseconds.
        _opts, _rest, order = command.make_parser(ctx).parse_args(args=list(args))
        _refuse_repeats(order)
        quiet = sum(1 for param in order if param.name == "quiet")
        verbose = sum(1 for param in order if param.name == "verbose")
        if quiet and verbose:
            raise BadInput("-q/--quiet and -v/--verbose contradict each other: give one of them")
        from stager.cli import terminal

        terminal.set_verbosity(-1 if quiet else verbose)
        return parse(ctx, args)

    command.parse_args = parse_args


def _refuse_repeats(order: list) -> None:
    """Exit 2 when an option that takes one value is given more than once: `--node a --node b`
    staged b, silently. Repeatable options (`--model`, `--rank`) and flags may repeat."""
    seen: set[int] = set()
    for param in order:
        single = param.param_type_name == "option" and not param.multiple and not param.count \
            and not param.is_flag
        if single and id(param) in seen:
            names = "/".join(sorted(param.opts, key=len))
            raise BadInput(f"{names} given more than once: it takes one value")
        seen.add(id(param))


# Typer names a value after its Python type ("<str>", "<list[int]>", "<int range>"); operators
# read words. Options that name their own metavar keep it; the rest are named here, once.
_TYPE_WORDS = {int: "N", float: "N"}


def _word_placeholders(command) -> None:
    for sub in _commands(command):
        for param in sub.params:
            if param.param_type_name == "argument":
                param.metavar = param.metavar or (param.name or "value").upper()
                if not getattr(getattr(param, "type_descriptor", None), "is_choice", False):
                    param.display_type_rich = lambda ctx: None  # "SRC... DEST", not "SRC... DEST <list[str]>"
                continue
            if param.metavar is not None or getattr(param, "is_flag", False):
                continue
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            inner = getattr(annotation, "__args__", (annotation,))[0]  # Optional[int], list[int] -> int
            param.metavar = _TYPE_WORDS.get(inner) or (param.name or "value").upper()


# typer (0.2x) converts every option value through a pydantic TypeAdapter that it builds on first
# use: importing its adapter layer and building one adapter per option cost more than the rest of
# a warm `stage verify`. Words and whole numbers need no schema; those options get a plain
# conversion here, with the same range check and an equally short message. Anything else (a
# choice, a file, a type this table does not know), or another typer, keeps typer's own path.
def _plain_conversions(command) -> None:
    try:
        from typer._coercion import RuntimeParam
    except ImportError:
        return
    from dataclasses import dataclass
    from types import SimpleNamespace

    @dataclass(frozen=True)
    class Plain(RuntimeParam):
        convert: type = str

        def _coerce_value(self, value, param, ctx):
            if isinstance(value, (list, tuple)):
                return [self._one(item, param, ctx) for item in value]
            return self._one(value, param, ctx)

        def _one(self, value, param, ctx):
            if self.convert in (int, float):
                from stager.base.units import parse_number

                try:
                    return parse_number(value, self.convert, self.parameter_info.min, self.parameter_info.max)
                except ValueError as exc:
                    raise typer.BadParameter(str(exc), ctx=ctx, param=param) from None
            try:
                return self.convert(value)
            except (TypeError, ValueError):
                raise typer.BadParameter(f"{value!r} is not a {_KIND[self.convert]}", ctx=ctx, param=param) from None

    help_names = SimpleNamespace(help_option_names=_HELP_NAMES)  # all get_help_option reads of a context
    for sub in (command, *_commands(command)):
        for param in (*sub.params, sub.get_help_option(help_names)):  # -h/--help is a typer option too
            desc = getattr(param, "type_descriptor", None)
            if desc is None or getattr(param, "_runtime_param", False) is not None:
                continue
            annotation = desc.annotation
            item = getattr(annotation, "__args__", (annotation,))[0] if getattr(annotation, "__origin__", None) is list \
                else annotation
            info = desc.parameter_info
            if item in _KIND and (item is not bool or getattr(param, "is_flag", False)) and not desc.is_choice and not desc.is_file and getattr(info, "parser", None) is None \
                    and not getattr(info, "click_type", None):
                param._runtime_param = Plain(parameter_info=info, annotation=annotation, convert=item)


_KIND = {str: "word", int: "whole number", float: "number", bool: "flag"}
