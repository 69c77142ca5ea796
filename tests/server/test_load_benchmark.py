"""The load benchmark still runs end to end (tiny sizes): both sides return every value intact, the
fill phase evicts with misses, not errors, and the cost phase accounts for both sides."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "server_load.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("server_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["server_load"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("server_load", None)


def test_server_load_benchmark_small(bench, tmp_path):
    out = tmp_path / "load.json"
    code = bench.main(
        [
            "--procs",
            "3",
            "--writes",
            "2",
            "--mixed",
            "8",
            "--repeats",
            "1",
            "--max-size",
            "256KiB",
            "--throughput-maxmemory",
            "64MiB",
            "--fill-maxmemory",
            "16MiB",
            "--cost-rounds",
            "1",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 0, report
    for side in ("raw", "store"):
        best = report["throughput"]["best"][side]
        assert best["ops"] == 3 * (2 + 8)
        assert best["hits"] == 3 * 6 and best["errors"] == best["corrupt"] == best["misses"] == 0
    throughput = report["throughput"]
    assert len(throughput["paired_ratios"]["bytes"]) == 1 and throughput["ratio_bytes"] > 0
    cost = report["cost"]
    for side in ("raw", "store"):
        assert cost[side]["client_s_per_gib"] > 0 and cost[side]["server_s_per_gib"] >= 0
    steps = cost["store_steps_s_per_gib"]
    assert 0 < steps["stored_fraction"] < 1  # compressible payloads shrink
    assert steps["us_per_sign"] > 0 and steps["us_per_verify"] > 0  # Ed25519, from the server's key pair
    fill = report["fill"]
    assert fill["server_up"] and fill["evicted_keys"] > 0 and fill["misses"] > 0
    assert fill["errors"] == fill["corrupt"] == 0
    assert fill["written_bytes"] >= 3 * 16 * 1024**2


def test_payloads_detect_corruption_and_mix_ups(bench):
    for compressible in (True, False):
        value = bench.payload("k1", 5000, compressible)
        assert len(value) == 5000 and bench.verify("k1", 5000, value)
        assert not bench.verify("k2", 5000, value)  # another key's value
        flipped = bytearray(value)
        flipped[-1] ^= 1
        assert not bench.verify("k1", 5000, bytes(flipped))
        assert not bench.verify("k1", 5000, value[:-1])
