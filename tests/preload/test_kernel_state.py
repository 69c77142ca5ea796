"""What a process's namespaces, credentials and confinement must share with a preloader to be handed
over, compared as the preloader compares them (the real processes are in test_preload.py)."""

from __future__ import annotations

import os

from warmstart.preload.kernel_state import isolation, isolation_difference, placement


def test_a_process_is_isolated_as_itself():
    mine = isolation()
    assert isolation_difference(mine, isolation()) is None
    assert {"mnt", "pid", "net", "gids", "groups"} <= set(mine)
    assert placement()["affinity"] == tuple(sorted(os.sched_getaffinity(0)))


def test_each_difference_is_named():
    mine = isolation()
    assert isolation_difference({**mine, "mnt": (0, 1)}, mine) == "another mount namespace (a container or unshare)"
    assert isolation_difference({**mine, "groups": (4321,)}, mine) == "other supplementary groups"
    assert isolation_difference({**mine, "root": (0, 2)}, mine) == "another root directory (chroot)"
    assert isolation_difference({**mine, "Seccomp": "2"}, mine) == "another seccomp mode (a sandbox)"
    assert isolation_difference({**mine, "label": "docker-default (enforce)"}, mine) is not None
    # A child can give itself no-new-privileges, never take it away.
    assert isolation_difference({**mine, "no_new_privs": "1"}, {**mine, "no_new_privs": "0"}) is None
    assert isolation_difference({**mine, "no_new_privs": "0"}, {**mine, "no_new_privs": "1"}) is not None
    # A request without them (another client) is not served.
    assert isolation_difference({}, mine) is not None
