"""Automatic compile spans from torch's own compile callbacks (real torch.compile)."""

from __future__ import annotations

import json

import torch

from warmstart.metrics import install_compile_spans, reset_process_recorder
from warmstart.metrics.auto import uninstall_compile_spans
from warmstart.metrics.calculator import compute, load_runs


def test_compile_spans_are_recorded_around_each_compilation(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSTART_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("WARMSTART_JOB_ID", "compile-job")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WARMSTART_ATTEMPT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    torch._dynamo.reset()
    assert install_compile_spans() and install_compile_spans()  # idempotent
    try:
        from warmstart.metrics import get_recorder

        rec = get_recorder()
        rec.attempt_start()
        fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="eager")
        fn(torch.randn(4))
        fn(torch.randn(4))  # cached: no second compilation
        fn(torch.randn(4, 4))  # new shape: a recompilation
        rec.step(0)
        rec.train_end()
        rec.attempt_end()
        rec.flush()
    finally:
        uninstall_compile_spans()
        reset_process_recorder()
        torch._dynamo.reset()
    lines = [json.loads(line) for line in (tmp_path / "events-r0-a0.jsonl").read_text().splitlines()]
    spans = [(line["event"], line.get("span")) for line in lines if line["event"] in ("begin", "end")]
    assert spans == [("begin", "compile"), ("end", "compile")] * 2
    (run,) = load_runs([tmp_path])
    result = compute(run)
    assert result.buckets["compile"] > 0
    assert result.l1["time_to_start_s"] >= result.buckets["compile"]
