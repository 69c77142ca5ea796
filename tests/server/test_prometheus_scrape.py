"""A real Prometheus scrapes the cache server's exporter (``server start --metrics-port``): its series
arrive with their names, node labels and values."""

from __future__ import annotations

import pytest
from _cli import start_json
from _prometheus import require_prometheus
from _redis import free_port_block

from warmstart.compile_cache.remote import RemoteTier


@pytest.mark.slow
def test_prometheus_scrapes_the_server_exporter(server_dir, prometheus_server):
    require_prometheus()
    port, metrics_port = free_port_block(1), free_port_block(1)
    info = start_json("--dir", str(server_dir), "--port", str(port), "--metrics-port", str(metrics_port))
    secret = open(info["secret_file"], "rb").read().strip()
    tier = RemoteTier(info["writer_url"], secret=secret, namespace="scraped-ns")
    assert tier.put("fx_graph", "k", b"x" * 5000) and tier.get("fx_graph", "k").value

    prom = prometheus_server([f"127.0.0.1:{metrics_port}"])
    node = f"127.0.0.1:{port}"

    def value(result: list) -> dict[str, float]:
        return {labels["__name__"]: v for labels, v in result if labels.get("node", node) == node}

    series = prom.wait_for('{__name__=~"warmstart_server_.*"}', lambda result: len(value(result)) >= 12)
    got = value(series)
    assert got["warmstart_server_up"] == 1 and got["warmstart_server_cluster_ok"] == 1
    assert (
        got["warmstart_server_keys"] == 2 and got["warmstart_server_maxmemory_bytes"] == 1024**3
    )  # the entry, the index
    assert got["warmstart_server_keyspace_hits_total"] >= 1  # a counter keeps its _total name
    assert 0 < got["warmstart_server_hit_ratio"] <= 1
    namespaces = {
        labels["namespace"]: v for labels, v in series if labels["__name__"] == "warmstart_server_namespace_bytes"
    }
    assert namespaces["scraped-ns"] > 0
