"""The code's lint and format, as ruff (configured in pyproject.toml) checks them: CI runs them through the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

CHECKED = ["quantforge", "tests", "scripts"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *CHECKED], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
