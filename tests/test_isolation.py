"""The suite writes nothing outside its own temporary directories, whoever runs it: HOME, the XDG
directories, TMPDIR and torch's caches point into one short root per run (``tests/_isolation.py``),
and pytest's base directory lies under it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _isolation import BASETEMP_VARIABLE, ROOT_VARIABLE, run_root

from warmstart.config import Settings

REPO = Path(__file__).resolve().parent.parent

# A job run with the suite's environment and no settings of its own: it writes to the default local tier.
WRITE_WITH_DEFAULTS = """
import os
from warmstart.compile_cache import open_store
from warmstart.config import Settings
store = open_store(Settings.from_env(os.environ))
store.put("fx_graph", "isolation", b"entry", sync=True)
store.get("fx_graph", "never-stored")  # a miss: logged under ./warmstart-runs/<job id>
store.close()
print(Settings.from_env(os.environ).cache_dir)
"""


def _runs_in_checkout() -> set[Path]:
    return {p for p in (REPO / "warmstart-runs", *(REPO / "tests").rglob("warmstart-runs")) if p.exists()}


def test_every_default_directory_is_in_the_run_root(tmp_path):
    root = run_root()
    assert len(os.fsencode(root)) <= len("/tmp/ws-XXXXXXXX")  # short by construction
    assert Path.home() == root / "home" and Path(tempfile.gettempdir()).is_relative_to(root)
    assert Path.cwd().is_relative_to(root)  # ./warmstart-runs of jobs without WARMSTART_RUN_DIR
    if os.environ.get(BASETEMP_VARIABLE):  # pytest's base directory too, unless --basetemp named one
        assert tmp_path.is_relative_to(os.environ[BASETEMP_VARIABLE]) and tmp_path.is_relative_to(root)
    for variable in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert Path(os.environ[variable]).is_relative_to(root), variable
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}
    done = subprocess.run(
        [sys.executable, "-c", WRITE_WITH_DEFAULTS], env={**env, "WARMSTART": "1"}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    cache_dir = Path(done.stdout.strip())
    assert cache_dir == Settings.from_env(env).cache_dir and cache_dir.is_relative_to(root)
    assert any(cache_dir.iterdir())
    assert list((Path.cwd() / "warmstart-runs").glob("*/cache-misses/*.ndjson"))


def test_a_run_leaves_the_users_home_and_tmp_untouched(tmp_path):
    """pytest run as a user whose home is ``home``: nothing lands in it, and the run's root is gone after."""
    home = tmp_path / "a-user-with-a-long-name-home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (ROOT_VARIABLE, BASETEMP_VARIABLE)
        and not k.startswith(("XDG_", "WARMSTART", "TORCHINDUCTOR", "TRITON", "PYTEST_XDIST"))
    }
    env.update(HOME=str(home), TMPDIR="/tmp")
    before = set(Path("/tmp").glob("ws-*"))
    runs_before = _runs_in_checkout()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"{__file__}::test_every_default_directory_is_in_the_run_root",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(home.iterdir()) == []
    assert _runs_in_checkout() == runs_before  # nothing in the checkout either
    assert set(Path("/tmp").glob("ws-*")) - before == set()  # its root was removed
