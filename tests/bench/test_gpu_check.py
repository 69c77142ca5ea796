"""``benchmarks/gpu_check.py``: its one line on a machine without CUDA, the table's parts on job results
as the jobs print them, and the whole flow on the CPU against a real redis-server (slow). On a CUDA
machine the last test runs the GPU models themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _redis import require_redis_server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def job(values: list[float], digest: str = "d0", compile_s: float = 10.0, **extra) -> dict:
    """A job's RESULT as gpu_job.py prints it (the fields the table reads)."""
    return {
        "model": "inductor",
        "device": "cuda",
        "loss": values[0],
        "values": values,
        "digest": digest,
        "compile_s": compile_s,
        "inductor": {},
        "aot_autograd": {},
        "dynamo": {"unique_graphs": 1, "calls_captured": 5},
        **extra,
    }


def counts(hits: int = 0, misses: int = 0) -> dict:
    return {
        "hits": hits,
        "misses": misses,
        "writes": 0,
        "errors": 0,
        "timeouts": 0,
        "rejected": 0,
        "dropped": 0,
        "bytes_read": 0,
        "bytes_written": 0,
        "read_s": 0.0,
        "saved_s": 0.0,
    }


COLD = job([0.5, 12.0, 30.0, 4.0, 2.5], digest="abc", compile_s=40.0)


def four_jobs(new_machine: dict | None = None) -> dict[str, dict]:
    new = new_machine or job(
        COLD["values"],
        digest="abc",
        compile_s=2.0,
        store={
            "local": {"fx_graph": counts(misses=2)},
            "remote": {"fx_graph": counts(hits=2), "triton_kernel": counts(hits=3), "autotune": counts(misses=1)},
        },
        dynamo={"unique_graphs": 0, "calls_captured": 0},
    )
    return {
        "cold": COLD,
        "torch local-warm": job(COLD["values"], digest="abc", compile_s=5.0),
        "warmstart producer": job(COLD["values"], digest="abc", compile_s=41.0),
        "warmstart new machine": new,
    }


# -- without CUDA --------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine without CUDA")
def test_without_cuda_prints_one_line_and_starts_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard
        env={**_env(), "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == gpu_check.NO_CUDA + "\n"
    assert list(tmp_path.iterdir()) == []  # no work dir, so no key, no redis-server, no job


def test_unknown_model_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--models", "inductor,resnet"])
    assert exc.value.code == 2
    assert "resnet" in capsys.readouterr().err


# -- the table's parts ----------------------------------------------------------------------------


def test_compare_exact_close_and_differs():
    assert gpu_check.compare(COLD, job(COLD["values"], digest="abc")) == "exact"
    nudged = [v * (1 + 3e-6) for v in COLD["values"]]  # another summation order
    assert gpu_check.compare(COLD, job(nudged, digest="other")) == "close"
    assert gpu_check.max_relative_difference(COLD, job(nudged)) == pytest.approx(3e-6, rel=1e-3)
    off = COLD["values"][:-1] + [COLD["values"][-1] * 1.01]
    assert gpu_check.compare(COLD, job(off, digest="other")) == "differs"
    assert gpu_check.compare(COLD, job(COLD["values"][:-1], digest="other")) == "differs"
    assert gpu_check.max_relative_difference(COLD, job(COLD["values"][:-1])) == float("inf")


def test_ratio_handles_missing_figures():
    assert gpu_check.ratio(2.0, 8.0) == 0.25
    assert gpu_check.ratio(None, 8.0) is None
    assert gpu_check.ratio(2.0, None) is None
    assert gpu_check.ratio(2.0, 0.0) is None


def test_row_of_a_model_whose_warm_results_all_match():
    summary = gpu_check.summarize("inductor", four_jobs())
    assert summary["ok"] and summary["same_result"]
    assert summary["ws_over_local_warm"] == pytest.approx(0.4)
    assert summary["ws_over_cold"] == pytest.approx(0.05)
    row = gpu_check.table_row(summary)
    assert len(row) == len(gpu_check.TABLE_COLUMNS)
    assert row[:7] == ["inductor", "40.00", "5.00", "2.00", "0.40x", "0.050x", "yes, exact"]
    assert "shared-cache hits: fx_graph 2, triton_kernel 3" in row[7]
    assert row[7].endswith("misses: autotune 1")  # what the new machine still compiled


def test_close_results_pass_and_say_so():
    results = four_jobs()
    results["warmstart producer"] = job([v * (1 + 1e-6) for v in COLD["values"]], digest="retuned")
    summary = gpu_check.summarize("max-autotune", results)
    assert summary["ok"] and summary["same"]["warmstart producer"] == "close"
    assert gpu_check.table_row(summary)[6] == f"yes, within {gpu_check.RTOL:g}"


def test_a_different_result_fails_the_model():
    results = four_jobs()
    results["torch local-warm"] = job([0.5, 12.0, 31.0, 4.0, 2.5], digest="wrong")
    summary = gpu_check.summarize("inductor", results)
    assert not summary["ok"] and not summary["same_result"]
    row = gpu_check.table_row(summary)
    assert row[6] == "NO"
    assert row[7].startswith("differs from cold: torch local-warm")


def test_a_failed_job_fails_the_model_and_the_rest_still_shows():
    results = four_jobs()
    del results["warmstart new machine"]
    summary = gpu_check.summarize("cudagraphs", results, {"warmstart new machine": "exited with 1"})
    assert not summary["ok"]
    row = gpu_check.table_row(summary)
    assert row[1:4] == ["40.00", "5.00", "-"] and row[4] == row[5] == "-"
    assert row[6] == "?" and "warmstart new machine FAILED" in row[7]


def test_no_hits_on_the_new_machine_is_called_out():
    results = four_jobs(
        job(COLD["values"], digest="abc", compile_s=39.0, store={"remote": {"fx_graph": counts(misses=2)}})
    )
    assert "NO shared-cache hits" in gpu_check.table_row(gpu_check.summarize("inductor", results))[7]


def test_dynamo_frames_notes_show_what_dynamo_traced():
    new = job(
        COLD["values"],
        digest="abc",
        compile_s=1.0,
        store={"remote": {"dynamo_frames": counts(hits=1)}},
        dynamo={"unique_graphs": 0, "calls_captured": 0},
    )
    notes = gpu_check.table_row(gpu_check.summarize("dynamo-frames", four_jobs(new)))[7]
    assert "dynamo_frames 1" in notes and "graphs Dynamo traced: cold 1, new machine 0" in notes


def test_stats_of_all_processes_win_over_the_job_s_own():
    result = job(
        [1.0],
        store={"remote": {"fx_graph": counts(hits=1)}},
        store_all_processes={"remote": {"fx_graph": counts(hits=1), "triton_kernel": counts(hits=4)}},
    )
    assert gpu_check.remote_hits(result) == {"fx_graph": 1, "triton_kernel": 4}
    assert gpu_check.remote_hits(job([1.0])) == {}


def test_skipped_models_and_plan():
    assert gpu_check.plan(["inductor", "user-triton", "cudagraphs"], "cuda") == (
        ["inductor", "user-triton", "cudagraphs"],
        {},
    )
    to_run, skipped = gpu_check.plan(list(gpu_check.DEFAULT_MODELS), "cpu")
    assert to_run == ["inductor", "dynamo-frames"]
    assert set(skipped) == {"user-triton", "max-autotune", "cudagraphs"}
    summary = gpu_check.summarize("user-triton", {}, skipped=skipped["user-triton"])
    assert summary["ok"]
    row = gpu_check.table_row(summary)
    assert row[1:7] == ["-"] * 6 and row[7].startswith("skipped on cpu")


# -- end to end --------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("WARMSTART")}


def _run_check(tmp_path: Path, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    require_redis_server()  # the script starts its own
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(), "TMPDIR": str(tmp_path), "COLUMNS": "200"},
    )
    assert done.returncode == 0, f"gpu_check failed:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return done, json.loads(out.read_text())


@pytest.mark.slow
def test_cpu_flow_end_to_end(tmp_path):
    done, data = _run_check(tmp_path, ["--device", "cpu", "--models", "matmul"], timeout=300)
    for column in gpu_check.TABLE_COLUMNS:
        assert column in done.stdout
    assert "machine: CPU only" in done.stdout
    entry = data["models"]["matmul"]
    assert entry["errors"] == {}
    assert set(entry["results"]) == set(gpu_check.CONFIGS)
    summary = entry["summary"]
    assert summary["ok"] and summary["same_result"], summary
    # Identical compiled code on one CPU: the bytes match, not just the figures.
    assert set(summary["same"].values()) == {"exact"}
    new = entry["results"]["warmstart new machine"]
    assert sum(gpu_check.remote_hits(new).values()) > 0, new.get("store")
    assert "store" not in entry["results"]["cold"]  # warmstart off there
    assert data["ok"] is True


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_models_end_to_end(tmp_path):
    done, data = _run_check(tmp_path, ["--device", "cuda"], timeout=3600)
    assert "machine: GPU" in done.stdout
    for model in gpu_check.DEFAULT_MODELS:
        summary = data["models"][model]["summary"]
        assert summary["ok"] and summary["same_result"], (model, summary)
        assert gpu_check.remote_hits(data["models"][model]["results"]["warmstart new machine"]), model
