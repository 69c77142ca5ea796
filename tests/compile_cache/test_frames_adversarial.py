"""Compiled frames never compute what plain torch would not: adversarial cases (``_adversarial_cases.py``,
``_adversarial_ranks.py``) compiled on one machine under one condition fill a real redis-server
(signed with the producer's private key), then run on brand-new machines (public key only):

* under another condition, each case's result and gradients must equal eager PyTorch's there, and a
  case whose frames depend on a compiler setting must not install them;
* under the producer's own condition (the control), each case's frames must be installed, or the
  case proves nothing. Cases whose frames torch never packages are listed, and checked as always traced.

Real compiles, real ``torchrun`` with gloo for the rank-dependent cases.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _machine import machine_env

HERE = Path(__file__).resolve().parent
#: Hang guard for some forty small compiles on 2 cores: not a speed check.
HANG_GUARD_S = 900
#: Frames of these are never packaged (a ``functools.partial``, a read of ``os.environ``, a module
#: whose graph holds its buffers, a numpy scalar): a new machine always traces them.
NOT_PACKAGED = {"partial_argument", "environment_variable", "train_or_eval", "other_module_numpy_scalar"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_GUARD_S)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from _redis import RedisNode

    from warmstart.compile_cache.signing import generate_key_pair

    root = tmp_path_factory.mktemp("adversarial")
    generate_key_pair(root / "signing.key", root / "verify.pub")
    node = RedisNode(root / "redis").start()
    yield {"root": root, "url": node.url, "writer": str(root / "signing.key"), "reader": str(root / "verify.pub")}
    node.stop()
    shutil.rmtree(root, ignore_errors=True)


def _environment(cache: dict, machine: Path, key: str, **extra: str) -> dict:
    frames = {"WARMSTART_DYNAMO": "1", "WARMSTART_CACHE_URL": cache["url"], "WARMSTART_KEY_FILE": cache[key]}
    return machine_env(machine, **{**frames, **extra})


def _results(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _single(cache: dict, name: str, condition: str, key: str, cases: list[str] = ()) -> dict:
    machine = cache["root"] / name
    proc = subprocess.run(
        [sys.executable, str(HERE / "_adversarial_job.py"), *cases],
        cwd=machine.parent,
        text=True,
        env=_environment(cache, machine, key, ADVERSARIAL_CONDITION=condition),
        capture_output=True,
        timeout=HANG_GUARD_S,
    )
    return _results(proc)[0]


def _torchrun(cache: dict, name: str, ranks: int, **extra: str) -> dict:
    machine = cache["root"] / name
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # torchrun's agent binds a free port itself: a port picked here could be taken by another
        # test's process before the agent binds it
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(HERE / "_adversarial_ranks.py"),
    ]
    results = machine / "results"
    results.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        command,
        cwd=machine.parent,
        text=True,
        capture_output=True,
        timeout=HANG_GUARD_S,
        env=_environment(cache, machine, "writer", ADVERSARIAL_RESULTS=str(results), **extra),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {int(path.stem[4:]): json.loads(path.read_text()) for path in results.glob("rank*.json")}
    assert sorted(found) == list(range(ranks)), proc.stdout[-2000:]
    return found


def _verdicts(new: dict, control: dict) -> tuple[list[str], list[str]]:
    """(cases that computed something plain torch would not, or installed frames they must not),
    (cases whose control installed nothing though their frames are packaged)."""
    wrong = [name for name, r in new.items() if not r["same"] or (r["must_trace"] and r["installed"]) or r["error"]]
    vacuous = [
        name
        for name, r in control.items()
        if name not in NOT_PACKAGED and (not r["installed"] or not r["same"] or r["error"])
    ]
    return wrong, vacuous


def _table(title: str, new: dict, control: dict) -> str:
    rows = [f"{title}: {len(new)} cases", f"{'case':36} {'family':22} {'new machine':24} control"]
    for name, r in new.items():
        c = control[name]
        rows.append(
            f"{name:36} {r['family']:22} {'same' if r['same'] else 'WRONG':5} "
            f"{'installed' if r['installed'] else 'traced':18} {'installed' if c['installed'] else 'traced'}"
        )
    return "\n".join(rows)


def test_single_process_cases(cache):
    sys.path.insert(0, str(HERE))
    from _adversarial_cases import CASES

    names = list(CASES)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two producers on one machine, half the cases each
        halves = pool.map(
            lambda args: _single(cache, *args),
            [("producer-a", "x", "writer", names[0::2]), ("producer-b", "x", "writer", names[1::2])],
        )
        producer = {name: result for half in halves for name, result in half.items()}
    assert sorted(producer) == sorted(names)
    assert all(r["same"] and not r["error"] for r in producer.values()), producer
    with ThreadPoolExecutor(max_workers=2) as pool:
        new, control = pool.map(
            lambda args: _single(cache, *args), [("new", "y", "reader"), ("control", "x", "reader")]
        )
    print(_table("compiled frames, adversarial cases", new, control))
    wrong, vacuous = _verdicts(new, control)
    assert not wrong, {name: new[name] for name in wrong}
    assert not vacuous, {name: control[name] for name in vacuous}
    for name in NOT_PACKAGED:
        assert not control[name]["installed"] and new[name]["same"], (name, control[name])
    # Every family the cases stand for has a case whose stored frames a new machine refused.
    families = {r["family"] for r in new.values()} - {"globals"}
    refused = {r["family"] for name, r in new.items() if not r["installed"] and name not in NOT_PACKAGED}
    assert families <= refused, families - refused
    # A refusal is one line that names what differs.
    for name in ("class_attribute_in_function", "argv_length", "backends_flag", "global_module_hook"):
        assert len(new[name]["said"]) == 1 and " is " in new[name]["said"][0] and ", was " in new[name]["said"][0], new[
            name
        ]["said"]


def test_rank_dependent_cases(cache):
    """A one-rank job fills the cache (``is_initialized`` compiled before the process group exists);
    a two-rank job on new machines must compute each rank's own result; a second two-rank job (the
    control) installs each rank's frames."""
    _torchrun(cache, "ranks-producer", 1, ADVERSARIAL_BEFORE_INIT="1")
    new = _torchrun(cache, "ranks-new", 2)
    control = _torchrun(cache, "ranks-control", 2)
    for rank in (0, 1):
        print(_table(f"rank {rank}", new[rank], control[rank]))
        wrong, vacuous = _verdicts(new[rank], control[rank])
        assert not wrong, (rank, {name: new[rank][name] for name in wrong})
        assert not vacuous, (rank, {name: control[rank][name] for name in vacuous})
    # No machine before rank 1 of the new job had its rank: its rank-dependent frames are its own.
    assert not any(new[1][name]["installed"] for name in ("get_rank", "rank_shard", "rank0_branch")), new[1]
