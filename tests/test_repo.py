"""Repository hygiene: CI runs the README's test command, and the code is ruff-clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci_command in (ROOT / "README.md").read_text()


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is part of the test extras")
def test_ruff_clean():
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run(["ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
