"""torchrun's restarts rejoin the rendezvous at once; the first join keeps torch's random delay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from _redis import free_port

PY = sys.executable


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART", "TORCHELASTIC", "TORCH_"))}
    env.update(WARMSTART_PRELOAD="0", WARMSTART_CACHE_DIR=str(tmp_path / "cache"), **extra)
    return env


def test_a_restart_rejoins_at_once_and_the_first_join_keeps_its_delay(tmp_path):
    """A real c10d rendezvous (its own TCPStore), joined twice by one handler, as torchrun's agent does
    at a restart: torch draws the random delay both times; the rejoin skips it."""
    code = textwrap.dedent(f"""
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import handler_registry
        from warmstart import rendezvous

        assert rendezvous.skipped_delays() == 0
        params = RendezvousParameters(
            backend="c10d", endpoint="127.0.0.1:{free_port()}", run_id="t", min_nodes=1, max_nodes=1,
            is_host=True,
        )
        handler = handler_registry.create_handler(params)
        first = handler.next_rendezvous()
        print(rendezvous.skipped_delays(), first.rank, first.world_size)
        again = handler.next_rendezvous()
        print(rendezvous.skipped_delays(), again.rank, again.world_size)
        handler.shutdown()
    """)
    env = _env(tmp_path, WARMSTART="1")
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["0 0 1", "1 0 1"]


def test_torchrun_restarts_its_workers_without_the_delay(tmp_path):
    """torchrun itself (its agent in this interpreter, with logging on to see warmstart's line), one
    worker that fails its first attempt: the restart rejoins at once, and the worker runs again."""
    worker = tmp_path / "worker.py"
    attempts = tmp_path / "attempts"
    worker.write_text(
        textwrap.dedent(f"""
        import os, sys
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        with open({str(attempts)!r}, "a") as f:
            f.write(f"{{restart}}\\n")
        sys.exit(1 if restart == 0 else 0)
    """)
    )
    agent = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s');"
        " from torch.distributed.run import main; main(sys.argv[1:])"
    )
    args = ["--standalone", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.1", str(worker)]
    out = subprocess.run(
        [PY, "-c", agent, *args], env=_env(tmp_path, WARMSTART="1"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert attempts.read_text().split() == ["0", "1"]
    lines = [line for line in out.stderr.splitlines() if line.startswith("warmstart.rendezvous:")]
    line = "warmstart.rendezvous: warmstart: torchrun rejoins its rendezvous at once (no random delay of up to 0.3 s)"
    assert lines == [line]

    # Without warmstart, torch's own behaviour: the same restart, no line.
    attempts.unlink()
    out = subprocess.run([PY, "-c", agent, *args], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert attempts.read_text().split() == ["0", "1"]
    assert "warmstart.rendezvous" not in out.stderr
