"""torch's OpenMP wait policy (deepinfer/__init__.py): passive unless the user chose one, set only where torch is
not loaded yet, and a hint at engine start where it came too late."""
import os
import subprocess
import sys

import pytest

POLICY = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=120)


@pytest.mark.parametrize("given, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_import_sets_passive_unless_chosen(given, want):
    env = {} if given is None else {"OMP_WAIT_POLICY": given}
    assert _run("import deepinfer; " + POLICY, **env).stdout.split() == [want]


def test_torch_first_keeps_policy_unset_and_engine_start_says_so():
    code = ("import logging, torch, deepinfer; from deepinfer import platform; logging.basicConfig(); "
            "logging.getLogger('deepinfer').setLevel(logging.INFO); platform.set_threads(2); " + POLICY)
    out = _run(code)
    assert out.stdout.split() == ["None"]
    assert "OMP_WAIT_POLICY=PASSIVE" in out.stderr
    quiet = _run(code, OMP_WAIT_POLICY="ACTIVE")
    assert quiet.stdout.split() == ["ACTIVE"] and "OMP_WAIT_POLICY" not in quiet.stderr
