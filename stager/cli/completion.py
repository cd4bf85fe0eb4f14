"""Shell completion: `stage --install-completion` and `stage --show-completion SHELL`.

typer's own `--show-completion` takes no shell: it asks shellingham which shell runs `stage`, so
zsh's script could not be printed from bash, nor any script from a provisioning job with no shell
above it. Here `--show-completion` names the shell; `--install-completion` still installs for the
shell that runs it, as typer's does. The scripts, and the answers to the shell's completion
requests (`_STAGE_COMPLETE` in the environment), are typer's.
"""

from __future__ import annotations

import os

import typer

PROG = "stage"
COMPLETE_VAR = "_STAGE_COMPLETE"
# A word, not a typer choice: a choice's conversion loads pydantic, which every command would then
# pay for at start-up (the root's options are read on every run).
SHELLS = ("bash", "zsh", "fish")


def shells() -> list[str]:
    """What completes after --show-completion."""
    return list(SHELLS)


def serve_requests() -> None:
    """When the shell asks for completions, answer in typer's format, which its scripts read."""
    if os.environ.get(COMPLETE_VAR):
        from typer.completion import completion_init

        completion_init()


def show(ctx: typer.Context, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    if value not in SHELLS:
        raise typer.BadParameter(f"{value!r} is not a shell stage completes: {', '.join(SHELLS)}")
    from typer.completion import get_completion_script

    typer.echo(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=value))
    raise typer.Exit()


def install(ctx: typer.Context, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from typer.completion import _get_shell_name, install as typer_install

    shell = _get_shell_name()
    if shell not in SHELLS:
        raise typer.BadParameter(f"cannot tell which shell runs stage ({shell or 'none found'}); print the "
                                 "script with --show-completion SHELL and source it from the shell's rc file")
    shell, path = typer_install(shell=shell, prog_name=PROG, complete_var=COMPLETE_VAR)
    typer.echo(f"{shell} completion for stage installed in {path}; it takes effect in new shells")
    raise typer.Exit()
