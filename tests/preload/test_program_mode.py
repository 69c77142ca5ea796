"""Which interpreter command lines a preloader runs, and as what (``client.program_mode``)."""

from __future__ import annotations

import pytest

from warmstart.preload.client import program_mode


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train.py", "--lr", "1"], ("script", "train.py", ["--lr", "1"])),
        (["-u", "train.py"], ("script", "train.py", [])),
        (["-m", "pkg.mod", "-x"], ("module", "pkg.mod", ["-x"])),
        (["-mpkg.mod", "a"], ("module", "pkg.mod", ["a"])),
        (["-um", "pkg.mod"], ("module", "pkg.mod", [])),
        (["-c", "print(1)", "a"], ("command", "print(1)", ["a"])),
        (["-Bc", "print(1)"], ("command", "print(1)", [])),
        (["-ucprint(1)", "a"], ("command", "print(1)", ["a"])),
        (["-W", "error", "-X", "dev", "train.py"], ("script", "train.py", [])),
        (["-Werror", "-Xdev", "-m", "m"], ("module", "m", [])),
        (["--check-hash-based-pycs", "always", "t.py"], ("script", "t.py", [])),
        ([], None),  # the interactive prompt
        (["-"], None),  # a program read from stdin
        (["-i", "t.py"], None),
        (["-ui", "t.py"], None),
        (["--help"], None),
        (["-c"], None),
        (["-um"], None),
    ],
)
def test_a_command_line_is_run_as_the_interpreter_would_run_it(args, expected):
    assert program_mode(["python", *args]) == expected
