"""Idle OpenMP threads spin briefly in `assay` processes, unless the user chose a policy."""

import os
import subprocess
import sys

import pytest

from assay.core.threads import SPIN_COUNT, WAIT_POLICY, short_spin


@pytest.fixture
def clean_env(monkeypatch):
    """Neither variable set, and whatever `short_spin` sets undone after the test (monkeypatch
    restores only what it touched, and deleting an absent variable records nothing)."""
    for var in (WAIT_POLICY, SPIN_COUNT):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return monkeypatch


def test_short_spin_when_unset(clean_env):
    short_spin()
    assert os.environ[SPIN_COUNT] == "10000"
    assert WAIT_POLICY not in os.environ


@pytest.mark.parametrize("var, value", [(WAIT_POLICY, "ACTIVE"), (SPIN_COUNT, "300000")])
def test_user_choice_kept(clean_env, var, value):
    clean_env.setenv(var, value)
    short_spin()
    assert os.environ[var] == value
    assert (WAIT_POLICY in os.environ) == (var == WAIT_POLICY)
    assert (SPIN_COUNT in os.environ) == (var == SPIN_COUNT)


def test_entry_point_runs_before_torch_loads():
    """libgomp reads the policy when torch loads it: importing the CLI must not load torch."""
    code = "import sys, assay.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
