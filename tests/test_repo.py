"""Repository hygiene: CI runs the README's Quickstart commands, and the code is ruff-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_both_readme_quickstart_commands_verbatim():
    ci = (ROOT / ".ci/run").read_text()
    commands = dict(re.findall(r"^(FIRST|TEST)='(.+)'$", ci, re.MULTILINE))
    assert set(commands) == {"FIRST", "TEST"}
    assert 'eval "$FIRST"' in ci and 'eval "$TEST"' in ci
    readme_lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    for command in commands.values():
        assert command in readme_lines, f"README.md has no line {command!r}"
    # The first command is the first one a reader meets, the test command the second.
    code_lines = [line for line in readme_lines if line.startswith("pip install")]
    assert code_lines[:2] == [commands["FIRST"], commands["TEST"]]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is part of the test extras")
def test_ruff_clean():
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run(["ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
