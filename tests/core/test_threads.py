"""Idle OpenMP threads sleep in `assay` processes, unless the user chose a policy."""

import os
import subprocess
import sys

import pytest

from assay.core.threads import SPIN_COUNT, WAIT_POLICY, sleep_idle_threads


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    monkeypatch.delenv(SPIN_COUNT, raising=False)
    return monkeypatch


def test_passive_when_unset(clean_env):
    sleep_idle_threads()
    assert os.environ[WAIT_POLICY] == "PASSIVE"


@pytest.mark.parametrize("var, value", [(WAIT_POLICY, "ACTIVE"), (SPIN_COUNT, "300000")])
def test_user_choice_kept(clean_env, var, value):
    clean_env.setenv(var, value)
    sleep_idle_threads()
    assert os.environ[var] == value
    assert (WAIT_POLICY in os.environ) == (var == WAIT_POLICY)


def test_entry_point_runs_before_torch_loads():
    """libgomp reads the policy when torch loads it: importing the CLI must not load torch."""
    code = "import sys, assay.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
