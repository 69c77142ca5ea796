"""The multi-host network harness (``_network.FarServer``): a real ``redis-server`` in one network
namespace, clients in another, a delay relay between them. Needs root; skipped with the reason
where network namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis
from _network import FarServer, namespaces, remove_stale_namespaces, require_netns
from _wait import until

RTT_MS = 100
PIPELINE_RTT_MS = 200


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    require_netns()
    server = FarServer(tmp_path_factory.mktemp("far"), rtts_ms=(RTT_MS, PIPELINE_RTT_MS)).start()
    yield server
    server.stop()


def _connected(url: str) -> redis.Redis:
    """A client whose pooled connection is made (the handshake's round trips paid), in the calling
    thread's namespace: later commands and pipelines, one at a time, reuse it."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    client.ping()
    return client


def test_a_ping_across_the_delayed_path_takes_a_round_trip(far):
    def ping_s() -> float:
        with _connected(far.url(RTT_MS)) as client:
            start = time.perf_counter()
            assert client.ping()
            return time.perf_counter() - start

    assert far.in_client(ping_s) >= 0.95 * RTT_MS / 1000


def test_a_new_connection_pays_the_handshake_round_trip(far):
    def connect_and_ping_s() -> float:
        start = time.perf_counter()
        with redis.Redis.from_url(far.url(RTT_MS), single_connection_client=True) as client:
            client.ping()
            return time.perf_counter() - start

    # The TCP handshake and the PING at least (redis-py's own set-up commands come on top).
    assert far.in_client(connect_and_ping_s) >= 1.9 * RTT_MS / 1000


def test_set_and_get_across_the_direct_path(far):
    def set_get() -> bytes | None:
        with _connected(far.url(0)) as client:
            client.set("direct", b"value")
            return client.get("direct")

    assert far.in_client(set_get) == b"value"


def test_the_veth_pair_lives_only_in_the_namespaces(far):
    host = subprocess.check_output(["ip", "-o", "addr"], text=True)
    client = subprocess.check_output(["ip", "-n", far.client_ns, "-o", "addr"], text=True)
    assert far.client_ip not in host and far.server_ip not in host
    assert far.client_ip in client


def test_pipelined_commands_pay_one_round_trip_through_the_relay(far):
    def pipeline() -> tuple[list, float]:
        with _connected(far.url(PIPELINE_RTT_MS)) as client:
            client.delete("counter")
            pipe = client.pipeline(transaction=False)
            for _ in range(200):
                pipe.incr("counter")
            start = time.perf_counter()
            replies = pipe.execute()
            return replies, time.perf_counter() - start

    replies, seconds = far.in_client(pipeline)
    assert replies == list(range(1, 201))
    # The relay delays per trip, not per chunk: one round trip (a per-chunk delay, or sent one by
    # one, would be many); 3 leaves room for a loaded machine.
    assert PIPELINE_RTT_MS / 1000 * 0.95 <= seconds < 3 * PIPELINE_RTT_MS / 1000


def test_large_values_pass_intact_through_the_relay(far):
    value = os.urandom(8 << 20)

    def round_trip() -> bytes | None:
        with _connected(far.url(RTT_MS)) as client:
            client.set("large", value)
            return client.get("large")

    assert far.in_client(round_trip) == value


def test_the_producer_url_works_in_the_server_namespace(far):
    def set_local() -> None:
        with _connected(far.local_url) as client:
            client.set("from-producer", b"filled")

    def get_far() -> bytes | None:
        with _connected(far.url(RTT_MS)) as client:
            return client.get("from-producer")

    far.in_server(set_local)
    assert far.in_client(get_far) == b"filled"


def test_a_process_run_with_the_client_prefix_gets_the_environment_and_the_server(far):
    code = (
        "import os, redis; "
        "c = redis.Redis.from_url(os.environ['FAR_URL']); c.set('from-child', os.environ['FAR_VALUE']); "
        "print(c.get('from-child').decode())"
    )
    env = {**os.environ, "FAR_URL": far.url(0), "FAR_VALUE": "passed-through"}
    result = subprocess.run(
        [*far.client_prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "passed-through"


def test_teardown_leaves_no_namespace_or_process_even_when_the_body_raised(tmp_path):
    require_netns()
    with pytest.raises(RuntimeError, match="the body failed"), FarServer(tmp_path, rtts_ms=(50,)) as far:
        # A process the body started in the client namespace and left running.
        child = subprocess.Popen([*far.client_prefix, "sleep", "60"])
        pids = [far.redis.pid, far.relay.pid, child.pid]
        assert {far.server_ns, far.client_ns} <= set(namespaces())
        raise RuntimeError("the body failed")
    assert child.wait(10) != 0
    assert far.redis.poll() is not None and far.relay.poll() is not None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not {far.server_ns, far.client_ns} & set(namespaces())


def test_a_killed_run_leaves_no_process_and_its_namespaces_are_removed_by_the_next(tmp_path):
    require_netns()
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from _network import FarServer; "
        "far = FarServer(sys.argv[2], rtts_ms=(50,)).start(); "
        "print(json.dumps([far.server_ns, far.client_ns, far.redis.pid, far.relay.pid]), flush=True); "
        "sys.stdin.read()"
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.Popen(
        [sys.executable, "-c", code, tests, str(tmp_path / "killed")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    server_ns, client_ns, *pids = json.loads(run.stdout.readline())
    run.kill()  # no teardown runs: the server and the relay die with it (parent-death signal)
    run.wait()
    until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), timeout=10)
    assert {server_ns, client_ns} <= set(namespaces())  # left behind, empty
    removed = remove_stale_namespaces()
    assert {server_ns, client_ns} <= set(removed)
    assert not {server_ns, client_ns} & set(namespaces())
