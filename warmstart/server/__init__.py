"""The shared cache server behind ``warmstart server``: real ``redis-server`` processes (one node
or a Redis Cluster) with a generated configuration, ACL users, optional TLS, status and Prometheus
metrics. ``config`` says what a server is, ``acl`` who may do what, ``credentials`` keeps its
secrets, ``preflight`` checks the machine, ``process`` starts and stops it, ``cluster`` forms a
Cluster, ``status`` and ``metrics`` report on it.
"""

from warmstart.compile_cache.keyspace import KEY_PREFIX
from warmstart.server.config import ServerOptions, default_dir
from warmstart.server.credentials import Credentials
from warmstart.server.process import run_foreground, start, stop
from warmstart.server.state import ServerState
from warmstart.server.status import ServerStatus, collect

__all__ = [
    "KEY_PREFIX",
    "Credentials",
    "ServerOptions",
    "ServerState",
    "ServerStatus",
    "collect",
    "default_dir",
    "run_foreground",
    "start",
    "stop",
]
