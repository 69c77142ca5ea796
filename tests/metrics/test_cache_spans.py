"""The compile cache's store observer: waits on the shared tier become ``cache_fetch`` spans on the
process's existing recorder, and never start one."""

from __future__ import annotations

import json

import pytest

from warmstart.metrics import CacheSpans, get_recorder, reset_process_recorder
from warmstart.metrics.recorder import existing_recorder


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("WARMSTART_JOB_ID", "cache-spans")
    for name in ("RANK", "WARMSTART_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    reset_process_recorder()
    yield tmp_path / "run"
    reset_process_recorder()


def test_a_wait_is_a_cache_fetch_span_in_the_bucket_of_the_work(run_dir):
    rec = get_recorder()
    spans = CacheSpans()
    with spans.waiting("fx_graph"):
        pass
    with spans.waiting("sharding_plan"):
        pass
    spans.looked_up("fx_graph", "key", None)  # type: ignore[arg-type]  # records nothing
    rec.flush()
    lines = [json.loads(line) for line in (run_dir / "events-r0-a0.jsonl").read_text().splitlines()]
    assert [(line["event"], line["span"], line["bucket"]) for line in lines] == [
        ("begin", "cache_fetch", "compile"),
        ("end", "cache_fetch", "compile"),
        ("begin", "cache_fetch", "sharding_plan"),
        ("end", "cache_fetch", "sharding_plan"),
    ]
    assert lines[0]["job"] == "cache-spans" and lines[0]["ts"] <= lines[1]["ts"]


def test_the_span_ends_when_the_fetch_raises(run_dir):
    rec = get_recorder()
    with pytest.raises(TimeoutError), CacheSpans().waiting("fx_graph"):
        raise TimeoutError
    rec.flush()
    events = [json.loads(line)["event"] for line in (run_dir / "events-r0-a0.jsonl").read_text().splitlines()]
    assert events == ["begin", "end"]


def test_without_a_recorder_nothing_is_recorded_or_started(run_dir):
    assert existing_recorder() is None
    with CacheSpans().waiting("fx_graph"):
        pass
    assert existing_recorder() is None  # a compile worker reading the cache stays a bystander
    assert not run_dir.exists()


def test_a_wait_for_another_process_compile_is_a_cache_wait_span_in_the_compile_bucket(run_dir):
    rec = get_recorder()
    with CacheSpans().waiting_on_peer("aot_autograd"):
        pass
    rec.flush()
    lines = [json.loads(line) for line in (run_dir / "events-r0-a0.jsonl").read_text().splitlines()]
    assert [(line["event"], line["span"], line["bucket"]) for line in lines] == [
        ("begin", "cache_wait", "compile"),
        ("end", "cache_wait", "compile"),
    ]
