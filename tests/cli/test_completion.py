"""Shell completion: the scripts `stage --show-completion bash|zsh` prints, sourced by a real bash
and asked as the shells ask, complete commands, fleet commands, options and choices;
`stage --install-completion` installs into the running shell's rc files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def env(**extra: str) -> dict:
    return {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", **extra}


def stage(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "stage"), *args], capture_output=True, text=True, timeout=60, env=env(**extra))


def bash_completes(words: list[str]) -> list[str]:
    """What a bash that sourced `stage --show-completion bash` offers for `words` (the last being
    the word under the cursor), as its completion function sets COMPREPLY."""
    script = ('source <(stage --show-completion bash) && COMP_WORDS=("$@") && COMP_CWORD=$(( $# - 1 )) '
              '&& _stage_completion stage && printf "%s\\n" "${COMPREPLY[@]}"')
    result = subprocess.run(["bash", "-c", script, "bash", *words], capture_output=True, text=True, timeout=60,
                            env=env())
    assert result.returncode == 0 and not result.stderr, result.stderr
    return result.stdout.split()


def test_bash_script_completes_commands_options_and_choices():
    script = stage("--show-completion", "bash")
    assert script.returncode == 0 and "complete -o default -F _stage_completion stage" in script.stdout
    assert bash_completes(["stage", "fle"]) == ["fleet"]
    assert bash_completes(["stage", "fleet", "pr"]) == ["prune"]
    assert bash_completes(["stage", "mirror", "--bw"]) == ["--bwlimit"]
    assert bash_completes(["stage", "fleet", "mirror", "--sub"]) == []  # --subset is verify's, not mirror's
    assert bash_completes(["stage", "fleet", "verify", "--sub"]) == ["--subset"]
    assert bash_completes(["stage", "--show-completion", ""]) == ["bash", "zsh", "fish"]


def test_zsh_script_and_its_requests():
    script = stage("--show-completion", "zsh")
    assert script.returncode == 0 and script.stdout.startswith("#compdef stage\n"), script.stdout
    assert "_STAGE_COMPLETE=complete_zsh" in script.stdout
    if shutil.which("zsh"):
        assert subprocess.run(["zsh", "-n"], input=script.stdout, text=True).returncode == 0
    # The request the script makes, as zsh makes it: the words so far in _TYPER_COMPLETE_ARGS.
    answer = stage(_TYPER_COMPLETE_ARGS="stage fleet ", _STAGE_COMPLETE="complete_zsh")
    assert answer.returncode == 0 and answer.stdout.startswith("_arguments"), answer.stdout
    for command in ("mirror", "verify", "pack-engram", "audit", "prune"):
        assert f'"{command}":' in answer.stdout, answer.stdout
    answer = stage(_TYPER_COMPLETE_ARGS="stage mirror --bw", _STAGE_COMPLETE="complete_zsh")
    assert '"--bwlimit":' in answer.stdout, answer.stdout


@pytest.mark.parametrize("shell", ["tcsh", "", "mirror"])
def test_an_unknown_shell_is_exit_2(shell):
    result = stage("--show-completion", shell)
    assert result.returncode == 2 and not result.stdout, result.stderr
    assert "Invalid value for '--show-completion'" in result.stderr, result.stderr


def test_install_completion_into_the_running_bash(tmp_path):
    """Installed for the shell that runs it (bash here): a script and the rc line that sources it."""
    home = tmp_path / "home"
    home.mkdir()
    # A second command keeps bash from exec'ing stage: bash stays its parent, whatever runs the test.
    result = subprocess.run(["bash", "-c", "stage --install-completion; exit $?"], capture_output=True, text=True,
                            timeout=60, env=env(HOME=str(home)))
    assert result.returncode == 0, result.stderr
    installed = home / ".bash_completions" / "stage.sh"
    assert result.stdout == f"bash completion for stage installed in {installed}; it takes effect in new shells\n"
    assert installed.read_text().strip() == stage("--show-completion", "bash").stdout.strip()
    assert f"source '{installed}'" in (home / ".bashrc").read_text()
