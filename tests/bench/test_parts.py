"""The reference job's parts on their own (fast): data, configuration, model shapes, CLI checks, the
bench's cache server and page."""

from __future__ import annotations

import html
import subprocess
import sys

import numpy as np
import pytest
import torch
from _redis import require_redis_server

from warmstart.bench.config import JobConfig
from warmstart.bench.data import NUM_DENSE, ClickLogDataset, make_tables
from warmstart.bench.model import DenseOverArch
from warmstart.errors import ConfigError


@pytest.fixture(scope="module")
def tables():
    return make_tables(6, rows_min=100, rows_max=5000, seed=3)


def test_batches_are_a_function_of_rank_and_step(tables):
    a = ClickLogDataset(tables, 32, rank=0, seed=1)
    b = ClickLogDataset(tables, 32, rank=0, start_step=5, seed=1)
    first, again = a.batch(5), next(iter(b))  # a resumed loader starts with exactly that batch
    assert torch.equal(first.dense_features, again.dense_features)
    assert torch.equal(first.sparse_features.values(), again.sparse_features.values())
    assert torch.equal(first.labels, again.labels)
    other_rank = ClickLogDataset(tables, 32, rank=1, seed=1).batch(5)
    assert not torch.equal(first.sparse_features.values(), other_rank.sparse_features.values())


def test_batches_look_like_click_logs(tables):
    ds = ClickLogDataset(tables, 2048, rank=0, seed=1)
    batch = ds.batch(0)
    kjt = batch.sparse_features
    assert batch.dense_features.shape == (2048, NUM_DENSE)
    assert kjt.keys() == [t.feature for t in tables]
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}
    assert 0.05 < batch.labels.mean().item() < 0.6  # a click-through rate, not a coin flip
    for table, jt in zip(tables, kjt.to_dict().values(), strict=True):
        ids = jt.values().numpy()
        assert ids.min() >= 0 and ids.max() < table.num_embeddings
        assert abs(jt.lengths().float().mean().item() - table.mean_pooling) < 0.5
        # power law: the lowest 1% of ids draw more than ten times their share of the lookups
        assert np.mean(ids < max(1, table.num_embeddings // 100)) > 0.1


def test_dense_over_arch_returns_a_scalar_loss_and_logits():
    arch = DenseOverArch(num_sparse=4, dim=8, dense_layers=[16], over_layers=[16])
    loss, logits = arch(torch.randn(5, NUM_DENSE), torch.randn(5, 4 * 8, requires_grad=True), torch.ones(5))
    assert loss.shape == () and logits.shape == (5,)
    loss.backward()
    assert all(p.grad is not None for p in arch.parameters())


def test_config_round_trips_through_flags_and_rejects_bad_values():
    cfg = JobConfig(mode="baseline", steps=50, tables=70, dense_layers=(64, 32), fail_at_step=20)
    assert JobConfig.from_args(cfg.to_args()) == cfg
    with pytest.raises(ConfigError, match="--mode"):
        JobConfig(mode="fast")
    with pytest.raises(ConfigError, match="--fail-at-step"):
        JobConfig(steps=10, fail_at_step=10)
    with pytest.raises(ConfigError, match="--checkpoint-mode"):
        JobConfig(checkpoint_mode="later")


def test_cli_rejects_a_failure_step_past_the_end():
    done = subprocess.run(
        [sys.executable, "-m", "warmstart", "bench", "cold-vs-warm", "--steps", "10", "--fail-at-step", "12"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--fail-at-step" in done.stderr and "--steps" in done.stderr


def test_bench_cache_server_serves_signed_entries_until_stopped(tmp_path):
    require_redis_server()
    from warmstart.bench.supervise import CacheServer
    from warmstart.compile_cache import signing
    from warmstart.compile_cache.remote import RemoteTier
    from warmstart.server import ServerState

    server = CacheServer.start(tmp_path / "cache-server")
    try:
        keys = signing.load_key_file(server.signing_key_file)
        tier = RemoteTier(server.writer_url, keys=keys, namespace="bench-test")
        assert tier.put("fx_graph", "k", b"graph" * 100)
        assert tier.get("fx_graph", "k").value == b"graph" * 100
        tier.close()
    finally:
        server.stop()
    assert ServerState.load(server.directory).running_pids() == []


def test_bench_page_shows_the_figures_then_the_report_of_each_run(tmp_path):
    from warmstart.bench.cold_vs_warm import CONFIGS, ConfigResult
    from warmstart.bench.page import render_page
    from warmstart.metrics import compute_runs
    from warmstart.metrics.events import write_events

    results = {}
    for i, name in enumerate(CONFIGS):
        run_dir = tmp_path / name
        run_dir.mkdir()
        t0 = 1_700_000_000.0
        events = [
            ("attempt_start", 0, {"devices": 2}),
            ("begin", 0, {"span": "compile"}),
            ("end", 5 - i, {"span": "compile"}),
            ("step", 6, {"step": 0}),
            ("step", 7, {"step": 1}),
            ("train_end", 8, {}),
            ("attempt_end", 9, {}),
        ]
        write_events(
            run_dir / "events-r0-a0.jsonl",
            [
                {"ts": t0 + t, "job": f"{name}-job", "attempt": 0, "rank": 0, "event": kind, **fields}
                for kind, t, fields in events
            ],
        )
        (result,) = compute_runs([run_dir])
        results[name] = ConfigResult(
            name=name, run_dir=run_dir, log_path=run_dir / "job.log", wall_s=9.0, result=result, startup=[], cache={}
        )
    page = render_page(results)
    assert page.startswith("<!DOCTYPE html>") and "<title>warmstart bench cold-vs-warm</title>" in page
    table = page[page.index('<table class="intro">') : page.index("</table>")]
    assert all(f"<th>{html.escape(h)}</th>" in table for h in ("figure", *CONFIGS, "warm / baseline"))
    assert "<td>compile (s)</td><td>5.00</td><td>4.00</td><td>3.00</td><td>0.60x</td>" in table
    # The report of the three runs comes after the table, in the same page.
    report = page[page.index("</table>") :]
    assert "Plotly" in page and report.count('<section class="run">') == 3
    assert [report.index(f"{name}-job") for name in CONFIGS] == sorted(report.index(f"{name}-job") for name in CONFIGS)


def test_small_ratios_keep_their_third_decimal():
    from warmstart.bench.page import ratio_cell

    assert [ratio_cell(r) for r in (0.0464, 0.0251, 0.1, 0.604, 3.75, None)] == [
        "0.046x",
        "0.025x",
        "0.10x",
        "0.60x",
        "3.75x",
        "-",
    ]


def test_losses_take_the_restarted_attempts_and_compare_step_by_step(tmp_path):
    from warmstart.bench.cold_vs_warm import ConfigResult, loss_differences, losses

    def run(name: str, files: dict[str, str]) -> ConfigResult:
        run_dir = tmp_path / name
        run_dir.mkdir()
        for file, text in files.items():
            (run_dir / file).write_text(text)
        return ConfigResult(
            name=name, run_dir=run_dir, log_path=run_dir / "job.log", wall_s=0, result=None, startup=[], cache={}
        )

    # attempt 0 ran steps 0-2 and died writing step 3; attempt 1 resumed after step 1 and ran 2-3 again
    baseline = run(
        "baseline", {"losses-r0-a0.txt": "0 0.7\n1 0.6\n2 0.55\n3 0.5", "losses-r0-a1.txt": "2 0.5\n3 0.4\n"}
    )
    assert losses(baseline.run_dir) == {(0, 0): 0.7, (0, 1): 0.6, (0, 2): 0.5, (0, 3): 0.4}
    torn = run("cold", {"losses-r0-a0.txt": "0 0.7\n1 0.6\n2 0.5\n3 0.4", "losses-r0-a1.txt": "2 0.5\n3 0.4000001\n4"})
    assert losses(torn.run_dir) == {(0, 0): 0.7, (0, 1): 0.6, (0, 2): 0.5, (0, 3): 0.4000001}
    warm = run("warm", {"losses-r0-a0.txt": "0 0.7\n1 0.6\n", "notes.txt": "not a loss file\n"})
    differences = loss_differences({"baseline": baseline, "cold": torn, "warm": warm})
    assert differences["cold"]["compared"] == 4 and differences["cold"]["baseline"] == 4
    assert differences["cold"]["max_abs_diff"] == pytest.approx(1e-7)
    assert differences["warm"] == {"max_abs_diff": 0.0, "compared": 2, "baseline": 4}
    nothing = run("nothing", {})
    assert loss_differences({"baseline": nothing, "cold": nothing, "warm": nothing})["cold"]["max_abs_diff"] is None
