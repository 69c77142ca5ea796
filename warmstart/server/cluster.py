"""Forming N started nodes into a Redis Cluster.

This module owns the step between "N cluster-enabled masters answer" and "the Cluster serves every
slot": it recognises nodes that already formed a Cluster together (a restart from the same
directory keeps ``nodes.conf``), otherwise runs ``redis-cli --cluster create`` as the admin user,
then waits for ``cluster_state:ok`` on every node. It starts and stops no process.
"""

from __future__ import annotations

import os
import subprocess
import time

from warmstart.errors import WarmstartError
from warmstart.server.credentials import Credentials
from warmstart.server.state import ServerState

_CREATE_TIMEOUT_S = 60.0
_READY_TIMEOUT_S = 20.0
_ALL_SLOTS = 16384


def form(state: ServerState, credentials: Credentials, redis_cli: str) -> None:
    """Make the started nodes of ``state`` one Cluster that covers every slot.

    Raises:
        WarmstartError: ``redis-cli --cluster create`` failed or the Cluster did not become ready.
    """
    opts = state.options
    infos = [_cluster_info(state, credentials, port) for port in opts.ports]
    already_formed = all(
        int(i.get("cluster_known_nodes", 0)) == len(opts.ports)
        and int(i.get("cluster_slots_assigned", 0)) == _ALL_SLOTS
        for i in infos
    )
    if not already_formed:
        if any(int(i.get("cluster_known_nodes", 1)) > 1 for i in infos):
            # Leftovers of a Cluster of another shape: start from blank nodes.
            for port in opts.ports:
                client = state.client(port, credentials=credentials)
                client.execute_command("FLUSHALL")
                client.execute_command("CLUSTER", "RESET", "HARD")
                client.close()
        _create(state, credentials, redis_cli)
    _wait_ok(state, credentials)


def _create(state: ServerState, credentials: Credentials, redis_cli: str) -> None:
    opts = state.options
    host = opts.host
    args = [
        redis_cli,
        "--user",
        "admin",
        "--cluster",
        "create",
        *[f"{host}:{p}" for p in opts.ports],
        "--cluster-replicas",
        "0",
        "--cluster-yes",
    ]
    if opts.tls:
        args[1:1] = ["--tls", "--cacert", str(opts.ca_file), "--cert", str(opts.tls_cert), "--key", str(opts.tls_key)]
    # The password goes through the environment, never the command line (visible in ps).
    env = {**os.environ, "REDISCLI_AUTH": credentials.passwords["admin"]}
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=_CREATE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise WarmstartError(f"redis-cli --cluster create did not finish in {_CREATE_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip() and "Warning" not in ln]
        raise WarmstartError(f"redis-cli --cluster create failed: {lines[-1] if lines else done.returncode}")


def _cluster_info(state: ServerState, credentials: Credentials, port: int) -> dict[str, str]:
    client = state.client(port, credentials=credentials)
    try:
        return client.cluster("info")
    finally:
        client.close()


def _wait_ok(state: ServerState, credentials: Credentials) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    for port in state.options.ports:
        while _cluster_info(state, credentials, port).get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise WarmstartError(
                    f"the Redis Cluster did not reach cluster_state:ok within {_READY_TIMEOUT_S:.0f}s "
                    f"(node {state.options.host}:{port}; see its redis.log under {state.options.dir})"
                )
            time.sleep(0.05)
