"""Live metrics (docs/metrics.md#live-metrics): a real job's exporter, scraped by a real Prometheus and
written as a node_exporter textfile, shows the figures ``warmstart ett report --json`` computes for
the same run; the recording rules give ``warmstart ett fleet``'s figure; a port that is taken, a file
that cannot be written or a bad setting cost one warning line and never the job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _prometheus import require_prometheus
from _redis import free_port
from prometheus_client.parser import text_string_to_metric_families

from warmstart.config import MetricsSettings
from warmstart.metrics import Recorder, compute_runs, write_events
from warmstart.metrics.live import Exporter, process_outputs, start_exporter

JOB = Path(__file__).with_name("_live_job.py")
RULES = Path(__file__).parents[2] / "server" / "prometheus" / "warmstart.rules.yml"
_OWN_LABELS = ("job_id", "rank", "instance", "job", "__name__")


def _env(run_dir: Path, job_id: str, **extra: str) -> dict[str, str]:
    """The environment of a job process: only the variables a test gives, none inherited from the runner."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WARMSTART", "TORCHELASTIC")) and k not in ("RANK", "LOCAL_RANK")
    }
    env.update(WARMSTART_RUN_DIR=str(run_dir), WARMSTART_JOB_ID=job_id, WARMSTART_METRICS_INTERVAL_S="0.2", **extra)
    return env


def _job(mode: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(JOB), mode, *args], env=env, capture_output=True, text=True, timeout=120)


def _cli_json(*args: str):
    done = subprocess.run(
        [sys.executable, "-m", "warmstart", "ett", *args, "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _expected(report: dict) -> dict[str, float]:
    """What the exporter must show for the run ``report`` (one object of ``ett report --json``)."""
    attempts = report["attempts"]
    out = {
        "warmstart_ett_percent": report["ett_pct"],
        "warmstart_ett_recent_percent": report["ett_pct"],  # the whole job lies inside the last 5 minutes
        "warmstart_ett_e2e_seconds": report["e2e_s"],
        "warmstart_ett_devices": report["devices"],
        "warmstart_ett_attempts_total": len(attempts),
        "warmstart_ett_steps_total": sum(a["steps"] for a in attempts),
        "warmstart_ett_last_committed_step": attempts[-1]["last_committed_step"],
    }
    out.update({f'warmstart_ett_bucket_seconds{{bucket="{name}"}}': s for name, s in report["buckets"].items()})
    for category in ("infra", "preemption", "user"):
        out[f'warmstart_ett_failures_total{{category="{category}"}}'] = report["l1"]["failures_by_category"].get(
            category, 0
        )
    return out


def _key(name: str, labels: dict[str, str]) -> str:
    extra = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in _OWN_LABELS)
    return f"{name}{{{extra}}}" if extra else name


def _textfile_samples(path: Path) -> list:
    return [sample for family in text_string_to_metric_families(path.read_text()) for sample in family.samples]


# -- through a real Prometheus -----------------------------------------------------------------------


@pytest.mark.slow
def test_prometheus_scrapes_what_ett_report_computes(tmp_path, prometheus_server):
    require_prometheus()
    port, run_dir = free_port(), tmp_path / "run"
    env = _env(run_dir, "job-live")
    prom = prometheus_server([f"127.0.0.1:{port}"], rule_files=[RULES])
    first = _job("fail", env)  # attempt 0 dies; the restart's exporter reads its events too
    assert first.returncode == 0, first.stderr
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    restart = subprocess.Popen(
        [sys.executable, str(JOB), "finish", "--cache-dir", str(cache_dir), "--hold"],
        env={**env, "WARMSTART_ATTEMPT": "1", "WARMSTART_METRICS_PORT": str(port)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert restart.stdout.readline().strip() == "ready"
        (report,) = _cli_json("report", str(run_dir))
        fleet = _cli_json("fleet", str(run_dir))
        assert report["l1"]["failures_by_category"] == {"infra": 1} and len(report["attempts"]) == 2

        expected = _expected(report)
        series = prom.wait_for(
            '{__name__=~"warmstart_ett_.*", job_id="job-live"}',
            lambda result: (
                {_key(labels["__name__"], labels): value for labels, value in result}
                == pytest.approx(expected, rel=1e-9, abs=1e-9)
            ),
        )
        assert {(labels["rank"], labels["instance"]) for labels, _ in series} == {("0", f"127.0.0.1:{port}")}

        cache = prom.wait_for('{__name__=~"warmstart_cache_.*", job_id="job-live"}', lambda result: len(result) == 2)
        assert {_key(labels["__name__"], labels): value for labels, value in cache} == {
            'warmstart_cache_hits_total{kind="fx_graph",tier="local"}': 1,
            'warmstart_cache_misses_total{kind="fx_graph",tier="local"}': 1,
        }

        # The recording rules: fleet ETT% weighted by devices, as `warmstart ett fleet` computes it.
        prom.wait_for(
            "warmstart:fleet_ett_percent",
            lambda result: len(result) == 1 and result[0][1] == pytest.approx(fleet["ett_pct"], rel=1e-9),
        )
        prom.wait_for(
            'job_id:warmstart_ett_device_seconds:max{job_id="job-live"}',
            lambda result: [v for _, v in result] == pytest.approx([fleet["device_seconds"]], rel=1e-9),
        )
    finally:
        restart.stdin.close()
        restart.wait(timeout=60)
        stderr = restart.stderr.read()
    assert restart.returncode == 0, stderr
    assert "warmstart" not in stderr


def test_rules_file_is_valid():
    promtool = Path(require_prometheus()).with_name("promtool")
    if not promtool.exists():
        pytest.skip("promtool is not next to prometheus")
    done = subprocess.run([str(promtool), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# -- the textfile -----------------------------------------------------------------------------------


def test_textfile_holds_the_final_figures_of_the_report(tmp_path):
    run_dir, textfile = tmp_path / "run", tmp_path / "textfile" / "warmstart.prom"
    textfile.parent.mkdir()
    done = _job("finish", _env(run_dir, "job-file", WARMSTART_METRICS_TEXTFILE=str(textfile)))
    assert done.returncode == 0 and done.stderr == "", done.stderr

    samples = _textfile_samples(textfile)
    (report,) = _cli_json("report", str(run_dir))
    assert {_key(s.name, s.labels): s.value for s in samples} == pytest.approx(_expected(report), rel=1e-9, abs=1e-9)
    assert {(s.labels["job_id"], s.labels["rank"]) for s in samples} == {("job-file", "0")}
    assert os.listdir(textfile.parent) == ["warmstart.prom"]  # written through a renamed temporary file


@pytest.mark.parametrize("interval_s", ["0.2", "600"], ids=["refreshing", "no-refresh-after-the-lookups"])
def test_the_final_textfile_keeps_the_cache_figures(tmp_path, interval_s):
    """The store hands its counts to the cache's stats file at exit, before the last textfile is
    written: the job's cache figures must not vanish from dashboards the moment it ends, whether or
    not the exporter's thread looked at the store while the job ran (on a loaded machine it may not)."""
    textfile, cache_dir = tmp_path / "warmstart.prom", tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    env = _env(tmp_path / "run", "job-cache", WARMSTART_METRICS_TEXTFILE=str(textfile))
    done = _job(
        "finish",
        {**env, "WARMSTART_METRICS_INTERVAL_S": interval_s},
        "--cache-dir",
        str(cache_dir),
        "--after-first-textfile",
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    cache = {
        _key(s.name, s.labels): s.value for s in _textfile_samples(textfile) if s.name.startswith("warmstart_cache")
    }
    assert cache == {
        'warmstart_cache_hits_total{kind="fx_graph",tier="local"}': 1,
        'warmstart_cache_misses_total{kind="fx_graph",tier="local"}': 1,
    }
    assert (cache_dir / "stats.json").exists()  # the counts went to the shared file as well


def test_live_figures_move_while_the_job_writes_nothing(tmp_path):
    """A job busy in its imports (or a compile) writes no event for a long time; its clock runs on."""
    textfile = tmp_path / "warmstart.prom"
    job = subprocess.Popen(
        [sys.executable, str(JOB), "start-up"],
        env=_env(tmp_path / "run", "job-busy", WARMSTART_METRICS_TEXTFILE=str(textfile)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 120  # a hang guard: a healthy job gets there in about 2 s

        def figures() -> dict[str, float]:
            try:
                return {_key(s.name, s.labels): s.value for s in _textfile_samples(textfile)}
            except (OSError, ValueError):
                return {}

        while figures().get('warmstart_ett_bucket_seconds{bucket="imports"}', 0) < 2:
            assert time.monotonic() < deadline and job.poll() is None, figures()
            time.sleep(0.1)
        seen = figures()
        assert seen["warmstart_ett_e2e_seconds"] >= 2 and seen["warmstart_ett_percent"] == 0
    finally:
        job.stdin.close()
        job.wait(timeout=60)
    assert job.returncode == 0, job.stderr.read()


def test_one_slow_refresh_does_not_space_the_next_ones(tmp_path):
    rec = Recorder(tmp_path, job="job-pause", rank=0, attempt=0, flush_interval_s=0)
    exporter = Exporter(rec, MetricsSettings(textfile=tmp_path / "w.prom", interval_s=1))
    assert exporter.pause_s() == 1
    exporter._costs.extend([2.0, 0.001, 0.002])  # a refresh slowed by a pause of the machine
    assert exporter.pause_s() == 1
    exporter._costs.extend([0.1, 0.1, 0.1])  # a long job: refreshes take 2% of a core at most
    assert exporter.pause_s() == pytest.approx(0.1 / 0.02)
    rec.close()


def test_devices_count_the_ranks_of_the_job(tmp_path):
    rec = Recorder(tmp_path, job="job-ranks", rank=0, attempt=0, flush_interval_s=0)
    exporter = Exporter(rec, MetricsSettings(textfile=tmp_path / "w.prom"), clock=lambda: 1_700_000_010.0)
    for rank in (0, 1):  # each rank declares its own device, as the reference job does
        write_events(
            tmp_path / f"events-r{rank}-a0.jsonl",
            [
                {
                    "ts": 1_700_000_000.0,
                    "job": rec.job,
                    "attempt": 0,
                    "rank": rank,
                    "event": "attempt_start",
                    "devices": 1,
                },
                {"ts": 1_700_000_001.0, "job": rec.job, "attempt": 0, "rank": rank, "event": "step", "step": 0},
            ],
        )
    assert exporter.refresh().devices == 2
    (result,) = compute_runs([tmp_path])
    assert result.devices == 2
    rec.close()


@pytest.mark.parametrize(
    "extra,rank_file",
    [
        ({}, "warmstart.prom"),
        ({"RANK": "1", "LOCAL_RANK": "1"}, None),  # rank 0 alone by default
        ({"RANK": "3", "LOCAL_RANK": "1", "WARMSTART_METRICS_RANKS": "all"}, "warmstart-1.prom"),
    ],
)
def test_which_ranks_export(tmp_path, extra, rank_file):
    textfile = tmp_path / "textfile" / "warmstart.prom"
    textfile.parent.mkdir()
    done = _job("finish", _env(tmp_path / "run", "job-ranks", WARMSTART_METRICS_TEXTFILE=str(textfile), **extra))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert os.listdir(textfile.parent) == ([rank_file] if rank_file else [])
    if rank_file:
        ranks = {s.labels["rank"] for s in _textfile_samples(textfile.parent / rank_file)}
        assert ranks == {extra.get("RANK", "0")}


def test_every_rank_of_a_machine_gets_its_own_port_and_file():
    settings = MetricsSettings(port=9400, textfile=Path("/t/w.prom"), all_ranks=True, local_rank=2)
    assert process_outputs(settings) == (9402, Path("/t/w-2.prom"))
    assert process_outputs(MetricsSettings(port=9400, textfile=Path("/t/w.prom"), local_rank=2)) == (
        9400,
        Path("/t/w.prom"),
    )


# -- faults: never the job --------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["port_taken", "textfile_unwritable", "bad_setting"])
def test_a_failing_exporter_is_one_warning_line_and_the_job_goes_on(tmp_path, fault):
    run_dir, textfile = tmp_path / "run", tmp_path / "warmstart.prom"
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    extra = {"WARMSTART_METRICS_TEXTFILE": str(textfile)}
    if fault == "port_taken":
        extra["WARMSTART_METRICS_PORT"] = str(port)
    elif fault == "textfile_unwritable":
        (tmp_path / "a-file").write_text("")
        extra["WARMSTART_METRICS_TEXTFILE"] = str(tmp_path / "a-file" / "warmstart.prom")
    else:
        extra["WARMSTART_METRICS_PORT"] = "http"
    try:
        done = _job("finish", _env(run_dir, "job-fault", **extra))
    finally:
        blocker.close()
    assert done.returncode == 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warmstart: live metrics off: "), done.stderr
    named = {
        "port_taken": f"port {port}",
        "textfile_unwritable": "a-file/warmstart.prom",
        "bad_setting": "WARMSTART_METRICS_PORT='http'",
    }[fault]
    assert named in lines[0]
    (report,) = _cli_json("report", str(run_dir))
    assert report["attempts"][0]["steps"] == 6 and report["ett_pct"] > 0  # the job's own events are whole
    if fault == "port_taken":  # the other delivery goes on
        assert {s.name for s in _textfile_samples(textfile)} >= {"warmstart_ett_percent"}


# -- the recent window --------------------------------------------------------------------------------


def _steps(rec: Recorder, first: int, start: float, step_s: float, n: int) -> list[dict]:
    return [
        {"ts": start + i * step_s, "job": rec.job, "attempt": 0, "rank": 0, "event": "step", "step": first + i}
        for i in range(n)
    ]


def test_recent_percent_covers_the_last_five_minutes_of_job_time(tmp_path):
    rec = Recorder(tmp_path, job="job-window", rank=0, attempt=0, flush_interval_s=0)
    t0 = 1_700_000_000.0
    now = [t0 + 600]  # the job's clock: its open attempt runs until then
    exporter = Exporter(rec, MetricsSettings(textfile=tmp_path / "w.prom"), clock=lambda: now[0])
    path = tmp_path / "scheduler.jsonl"
    write_events(
        path,
        [
            {"ts": t0, "job": rec.job, "attempt": 0, "rank": -1, "event": "attempt_start"},
            {"ts": t0, "job": rec.job, "attempt": 0, "rank": 0, "event": "begin", "span": "compile"},
            {"ts": t0 + 400, "job": rec.job, "attempt": 0, "rank": 0, "event": "end", "span": "compile"},
            *_steps(rec, 0, t0 + 400, 1.0, 201),
        ],
    )
    first = exporter.refresh()
    assert first.e2e_s == pytest.approx(600) and first.ett_pct == pytest.approx(100 * 200 / 600)
    assert first.recent_ett_pct is None  # this exporter has not watched five minutes of the job yet

    # 300 s more: 100 s of eval, then 200 s of steps (all effective). The window is exactly those.
    write_events(
        path,
        [
            {"ts": t0 + 600, "job": rec.job, "attempt": 0, "rank": 0, "event": "begin", "span": "eval"},
            {"ts": t0 + 700, "job": rec.job, "attempt": 0, "rank": 0, "event": "end", "span": "eval"},
            *_steps(rec, 201, t0 + 700, 1.0, 201),
        ],
    )
    now[0] = t0 + 900
    second = exporter.refresh()
    assert second.e2e_s == pytest.approx(900)
    assert second.recent_ett_pct == pytest.approx(100 * 200 / 300)
    (result,) = compute_runs([tmp_path])  # the other figures are the report's
    assert (second.ett_pct, second.steps, second.attempts) == (result.ett_pct, sum(a.steps for a in result.attempts), 1)
    rec.close()


def test_start_exporter_does_nothing_when_not_asked(tmp_path):
    rec = Recorder(tmp_path, job="job-off", rank=0, attempt=0, flush_interval_s=0)
    assert start_exporter(rec, MetricsSettings()) is None
    rec.close()
