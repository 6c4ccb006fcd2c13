"""`shardflow --help` imports no command module (and so neither torch, numpy nor fsspec)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from shardflow.cli import COMMANDS, build_parser, command_in


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_help_imports_neither_torch_numpy_fsspec_nor_a_command_module() -> None:
    script = (
        "import sys, contextlib, io\n"
        "from shardflow.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "heavy = [m for m in ('torch', 'numpy', 'fsspec', 'PIL') if m in sys.modules]\n"
        "commands = sorted(m for m in sys.modules if m.startswith('shardflow.cli.'))\n"
        "print(code, 'inspect' in out.getvalue(), 'bench' in out.getvalue(), heavy, commands)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "0 True True [] []"


def test_a_command_imports_only_its_own_module() -> None:
    script = (
        "import sys, contextlib, io\n"
        "from shardflow.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['index', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "shared = {'shardflow.cli.units', 'shardflow.cli.progress', 'shardflow.cli.options'}\n"
        "print(sorted(m for m in sys.modules if m.startswith('shardflow.cli.') and m not in shared),\n"
        "      'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "['shardflow.cli.index'] False"


def test_the_help_lines_listed_are_those_the_command_modules_register() -> None:
    full = _subcommands(build_parser())
    stub = _subcommands(build_parser([]))
    registered = {a.dest: a.help for a in full._choices_actions}
    assert registered == COMMANDS
    assert {a.dest: a.help for a in stub._choices_actions} == COMMANDS
    assert list(full.choices) == list(COMMANDS)


@pytest.mark.parametrize("argv, command", [
    (["--help"], None),
    ([], None),
    (["-v", "inspect", "x"], "inspect"),
    (["-vv", "--", "inspect"], None),
    (["inspct", "--json"], "inspct"),
])
def test_command_in_names_the_first_word_that_is_not_an_option(argv, command) -> None:
    assert command_in(argv) == command


def test_a_misspelled_command_is_reported_with_the_choices(capsys) -> None:
    from shardflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(["inspct", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'inspct'" in err and "'inspect'" in err
