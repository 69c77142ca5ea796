"""End to end: ``warmstart bench cold-vs-warm`` on a shortened reference job (real torchrun, gloo,
TorchRec, torch.compile, redis-server). Asserts on what the runs produced, never on speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _redis import require_redis_server

REFERENCE_KEYS = (
    "e2e_s",
    "ett_pct",
    "time_to_start_s",
    "time_to_recover_s",
    "compile_s",
    "sharding_plan_s",
    "checkpoint_blocking_s",
    "run_dir",
)
STEPS, FAIL_AT, EVERY = 10, 7, 4  # a checkpoint after step 3; the failure at 7 loses steps 4-6 (snapshots: fewer)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One shortened bench run shared by the tests of this module: (its JSON, its HTML, the work dir)."""
    require_redis_server()  # the bench starts its own cache server
    tmp = tmp_path_factory.mktemp("bench")
    out_json, out_html, work = tmp / "bench.json", tmp / "bench.html", tmp / "work"
    cmd = [
        sys.executable,
        "-m",
        "warmstart",
        "bench",
        "cold-vs-warm",
        "--steps",
        str(STEPS),
        "--tables",
        "8",
        "--batch-size",
        "64",
        "--checkpoint-every",
        str(EVERY),
        "--fail-at-step",
        str(FAIL_AT),
        "--work-dir",
        str(work),
        "--json",
        str(out_json),
        "--html",
        str(out_html),
        "--timeout",
        "600",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}{_job_logs(work)}"
    return json.loads(out_json.read_text()), out_html.read_text(), work, done.stdout


def _job_logs(work: Path) -> str:
    """The end of each configuration's log (a stalled run's Python stacks are there), for a failure's
    message: on a CI machine the work directory is gone once the run ends."""
    parts = []
    for log in sorted(work.glob("*/job.log")):
        parts.append(f"\n--- {log} (last 12000 characters)\n{log.read_text(errors='replace')[-12000:]}")
    return "".join(parts)


@pytest.mark.slow
def test_json_has_the_reference_keys_and_buckets_sum(bench):
    data, _, _, _ = bench
    for name in ("baseline", "cold", "warm"):
        figures = data[name]
        for key in REFERENCE_KEYS:
            assert key in figures, f"{name} lacks {key}"
        assert Path(figures["run_dir"]).is_dir()
        assert math.isclose(sum(figures["buckets"].values()), figures["e2e_s"], rel_tol=1e-6, abs_tol=1e-6)
        assert 0 < figures["ett_pct"] < 100
        assert figures["time_to_start_s"] > 0 and figures["time_to_recover_s"] > 0
        assert figures["compile_s"] > 0 and figures["sharding_plan_s"] > 0
        assert figures["checkpoint_blocking_s"] > 0
    assert set(data["warm_vs_baseline"]) >= {"time_to_start_s", "time_to_recover_s", "checkpoint_blocking_s"}


@pytest.mark.slow
def test_each_run_projected_onto_its_own_scale_gives_its_measured_ett(bench):
    data, _, _, _ = bench
    for name in ("baseline", "cold", "warm"):
        done = subprocess.run(
            [sys.executable, "-m", "warmstart", "ett", "project", data[name]["run_dir"], "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        (projection,) = json.loads(done.stdout)
        assert projection["inputs"]["failures_from"] == "run" and projection["devices"] == 2, name
        assert abs(projection["projected_ett_pct"] - data[name]["ett_pct"]) < 1, (name, projection)


@pytest.mark.slow
def test_every_configuration_failed_once_and_resumed_from_its_last_commit_or_snapshot(bench):
    data, _, _, _ = bench
    for name in ("baseline", "cold", "warm"):
        figures = data[name]
        assert figures["failures"] == 1, name
        first, second = figures["attempts"]
        assert first["failed"] and not second["failed"], name
        assert first["last_step"] == FAIL_AT  # the attempt died at the start of this step
        kept = first["last_committed_step"]  # the checkpoint, or the snapshot the restart restored
        if name == "baseline":  # a synchronous save is committed when it returns
            assert kept == (FAIL_AT // EVERY) * EVERY - 1
            assert second["resumed"] is None  # no snapshots: its events are those of a plain job
        else:
            # the buddy holds every step it received before the machine died (it may lag behind); with
            # none past the checkpoint, the restart loads the checkpoint alone
            assert second["resumed"] is not None and second["resumed"]["step"] == kept, name
            if second["resumed"]["source"] == "buddy":
                assert 0 <= kept <= FAIL_AT - 1, name
            else:
                assert second["resumed"] == {"step": EVERY - 1, "source": "checkpoint"}, name
            assert figures["snapshots"]["taken"] > 0 and figures["snapshots"]["rows_per_step"] > 0, name
        assert figures["resumed_from_step"] == [None, kept], name
        assert second["first_step"] == kept + 1 and second["last_step"] == STEPS - 1, name
        assert figures["lost_progress_s"] > 0, name  # the failed step's start, and any step not kept


@pytest.mark.slow
def test_every_configuration_trained_the_same_model(bench):
    data, _, _, stdout = bench
    for name in ("cold", "warm"):
        difference = data["loss_vs_baseline"][name]
        # every step of every rank, the restarted attempt's where a step ran twice
        assert difference["compared"] == difference["baseline"] == 2 * STEPS, name
        assert difference["max_abs_diff"] <= 1e-4, name
    assert "loss, largest difference from baseline" in stdout


@pytest.mark.slow
def test_fresh_machines_miss_and_the_shared_cache_hits(bench):
    data, _, work, _ = bench
    # baseline: both attempts compile from nothing (fresh local dirs, no shared cache). The two ranks of
    # an attempt share its machine, so one may read from torch's local cache a graph the other has just
    # written; every graph is still compiled on every attempt's machine.
    base = data["baseline"]["compile_counters"]
    assert base["fxgraph_cache_miss"] > 0
    for attempt in (0, 1):
        reports = [
            json.loads(p.read_text())["compile_counters"]
            for p in (work / "baseline" / "runs").glob(f"startup-r*-a{attempt}.json")
        ]
        graphs = max(r["fxgraph_cache_hit"] + r["fxgraph_cache_miss"] for r in reports)
        assert sum(r["fxgraph_cache_miss"] for r in reports) >= graphs, reports
    # warm: nothing is compiled, on both attempts: every graph comes from the server cold filled
    warm = data["warm"]["compile_counters"]
    assert warm["fxgraph_cache_miss"] == 0 and warm["autograd_cache_miss"] == 0
    # the restarted attempts ran on machines of their own
    for name in ("baseline", "cold", "warm"):
        assert sorted(p.name for p in (work / name / "machines").iterdir()) == ["attempt-0", "attempt-1"]
    # warm's restart (a clean exit, so its store counters were saved) got its plan from the cache
    cache = data["warm"]["cache"]
    assert sum(row["hits"] for key, row in cache.items() if key.endswith("/sharding_plan")) > 0
    # compiled frames are off by default: Dynamo traces, and no frames are stored or read
    assert not any(row["hits"] for key, row in cache.items() if key.endswith("/dynamo_frames"))


@pytest.mark.slow
def test_table_and_html_show_the_three_configurations(bench):
    _, page, _, stdout = bench
    for label in ("time to start", "time to recover", "checkpoint blocking", "ETT %"):
        assert label in stdout
    assert "warm /" in stdout  # the ratio's header, "warm / baseline", wrapped to fit 80 columns when piped
    assert max(len(line.rstrip()) for line in stdout.splitlines()) <= 80
    assert page.count('<section class="run">') == 3
    assert "warmstart bench cold-vs-warm" in page and "Plotly" in page


@pytest.mark.slow
def test_warm_ranks_fork_from_their_machines_preloaders(bench):
    from warmstart.metrics import compute_runs

    data, _, _, _ = bench
    assert data["settings"]["preload"] is True
    assert len(data["preload_start_s"]) == 2 and all(s > 0 for s in data["preload_start_s"])
    for name, forked in (("baseline", False), ("cold", False), ("warm", True)):
        (result,) = compute_runs([data[name]["run_dir"]])
        assert [a.forked for a in result.attempts] == [forked, forked], name
