"""What the kernel keeps for a process besides its memory, descriptors and environment, which a child
forked from a preloader would otherwise have from the preloader instead of from the process it runs
the program of.

Two kinds:

* **Isolation**, which the child cannot take on (or only with privileges a job must not need): the
  namespaces (mount, network, PID, IPC, UTS, user, cgroup, time: a container, ``unshare``), the
  root directory (``chroot``), the group ids and supplementary groups, the capability sets,
  no-new-privileges where the preloader has it, the seccomp mode and the security label (AppArmor,
  SELinux). A request is served only where these are the preloader's: a program must never run
  outside its container, or with groups, capabilities or a sandbox that are not its own.
* **Placement**, which the child takes on before the program runs: CPU affinity (``taskset``,
  Slurm's ``--cpu-bind``, torchrun's ``--numa-binding``), niceness, scheduling policy (``chrt``),
  I/O priority (``ionice``), OOM score adjustment and no-new-privileges. Where the kernel does not
  permit it (a higher priority than the preloader's without the privilege) and for a NUMA memory
  policy (``numactl --membind``/``--interleave``) other than the default, the process starts as
  usual. The CPUs a process may run on also decide how many threads torch starts, unless
  ``OMP_NUM_THREADS`` says: a process on other CPUs without it starts as usual too.

:func:`isolation` and :func:`placement` run in the interpreter's start-up hook of every process that
could be handed over: built-in modules only, a few reads of ``/proc/self``.
"""

from __future__ import annotations

import os

#: Namespaces a process can be in (``/proc/self/ns``), each compared by its inode.
NAMESPACES = ("mnt", "net", "pid", "ipc", "uts", "user", "cgroup", "time")

#: Lines of ``/proc/self/status`` that a child cannot change to the process's.
_STATUS_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "Seccomp", "Seccomp_filters")

#: What each isolation difference is, in the one line a process that starts as usual logs.
_ISOLATION_NAMES = {
    "mnt": "another mount namespace (a container or unshare)",
    "net": "another network namespace",
    "pid": "another PID namespace",
    "ipc": "another IPC namespace",
    "uts": "another UTS namespace (host name)",
    "user": "another user namespace",
    "cgroup": "another cgroup namespace",
    "time": "another time namespace",
    "root": "another root directory (chroot)",
    "gids": "other group ids",
    "groups": "other supplementary groups",
    "CapInh": "other capabilities",
    "CapPrm": "other capabilities",
    "CapEff": "other capabilities",
    "CapBnd": "another capability bounding set",
    "CapAmb": "other ambient capabilities",
    "Seccomp": "another seccomp mode (a sandbox)",
    "Seccomp_filters": "other seccomp filters (a sandbox)",
    "label": "another security label (AppArmor or SELinux)",
    "personality": "another execution domain (setarch)",
    "loginuid": "another audit login id (a login after the preloader started)",
    "sessionid": "another audit session id (a login after the preloader started)",
    "session_keyring": "another session keyring (keyctl new_session, a login after the preloader started)",
}


def read_proc(path: str) -> str:
    """The text of ``path`` (a ``/proc`` file); empty where it cannot be read (another kernel, a
    sandbox that hides it)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def isolation() -> dict:
    """This process's namespaces, root directory, group ids, capabilities, no-new-privileges flag,
    seccomp mode and security label."""
    found: dict = {}
    for name in NAMESPACES:
        try:
            st = os.stat(f"/proc/self/ns/{name}")
        except OSError:  # a kernel without this namespace
            continue
        found[name] = (st.st_dev, st.st_ino)
    root = os.stat("/")
    found["root"] = (root.st_dev, root.st_ino)
    found["gids"] = tuple(os.getresgid())
    found["groups"] = tuple(sorted(os.getgroups()))
    status = _status()
    for field in _STATUS_FIELDS:
        if field in status:
            found[field] = status[field]
    found["no_new_privs"] = status.get("NoNewPrivs", "0")
    found["label"] = read_proc("/proc/self/attr/current").strip("\0\n ")
    for name in ("personality", "loginuid", "sessionid"):  # what the kernel fixes at exec or login
        found[name] = read_proc(f"/proc/self/{name}").strip()
    found["session_keyring"] = _session_keyring()
    return found


def _session_keyring() -> int:
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0): a child has its preloader's, and
    # would read (or fail to read) the secrets kept there instead of the process's.
    number = _KEYCTL.get(os.uname().machine)
    if number is None:
        return 0
    ctypes, libc = _libc()
    found = libc.syscall(number, 0, -3, 0)
    return int(found) if found >= 0 else -ctypes.get_errno()


def isolation_difference(theirs: dict, mine: dict) -> str | None:
    """Why a process of isolation ``theirs`` cannot be run by a child of a preloader of isolation
    ``mine`` (:func:`isolation` of each), or ``None`` when it can."""
    for key, what in _ISOLATION_NAMES.items():
        if theirs.get(key) != mine.get(key):
            return what
    if mine.get("no_new_privs") == "1" and theirs.get("no_new_privs") != "1":
        return "no-new-privileges off (the preloader has it on, and a child cannot turn it off)"
    return None


def placement() -> dict:
    """This process's CPU affinity, niceness, scheduling policy and OOM score adjustment (its I/O
    priority and memory policy are read by the child, from its pid)."""
    return {
        "affinity": tuple(sorted(os.sched_getaffinity(0))),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "policy": os.sched_getscheduler(0),
        "priority": os.sched_getparam(0).sched_priority,
        "oom_score_adj": read_proc("/proc/self/oom_score_adj").strip(),
        "timer_slack_ns": read_proc("/proc/self/timerslack_ns").strip(),
    }


def take_on(theirs: dict, isolated: dict, pid: int) -> bool:
    """In a preloader's child, before the program: take on the placement ``theirs`` (:func:`placement`
    of process ``pid``), its I/O priority and its no-new-privileges flag (from ``isolated``, its
    :func:`isolation`), and check that its NUMA memory policy is the child's. Raises (the process
    then starts as usual) where the kernel does not permit one of them. Returns whether the CPU
    affinity changed."""
    mine = placement()
    moved = bool(theirs.get("affinity")) and tuple(theirs["affinity"]) != mine["affinity"]
    if moved:
        os.sched_setaffinity(0, theirs["affinity"])
    if "nice" in theirs and theirs["nice"] != mine["nice"]:
        _permitted("niceness", os.setpriority, os.PRIO_PROCESS, 0, theirs["nice"])
    if "policy" in theirs and (theirs["policy"], theirs["priority"]) != (mine["policy"], mine["priority"]):
        _permitted("scheduling policy", os.sched_setscheduler, 0, theirs["policy"], os.sched_param(theirs["priority"]))
    if theirs.get("oom_score_adj") and theirs["oom_score_adj"] != mine["oom_score_adj"]:
        _permitted("OOM score adjustment", _write, "/proc/self/oom_score_adj", theirs["oom_score_adj"])
    if theirs.get("timer_slack_ns") and theirs["timer_slack_ns"] != mine["timer_slack_ns"]:
        prctl(_PR_SET_TIMERSLACK, int(theirs["timer_slack_ns"]))
    if isolated.get("no_new_privs") == "1" and _status().get("NoNewPrivs") != "1":
        prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _take_on_io_priority(pid)
    _check_memory_policy(pid)
    return moved


def _permitted(what: str, call, *args) -> None:
    try:
        call(*args)
    except PermissionError as exc:
        raise PermissionError(f"the process's {what} is not permitted to the preloader's child ({exc})") from None


# -- I/O priority and NUMA memory policy: system calls of their own ------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_TIMERSLACK = 29
_IOPRIO_WHO_PROCESS = 1
#: keyctl by machine
_KEYCTL = {"x86_64": 250, "aarch64": 219}
#: (ioprio_get, ioprio_set, get_mempolicy) by machine
_SYSCALLS = {"x86_64": (252, 251, 239), "aarch64": (31, 30, 236)}


def _libc():
    import ctypes  # imported by torch in a preloader's children; in a process only where one serves

    return ctypes, ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    """``prctl(option, value)`` on this process; raises :class:`OSError` when it fails."""
    ctypes, libc = _libc()
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _syscalls() -> tuple[int, int, int] | None:
    return _SYSCALLS.get(os.uname().machine)


def _take_on_io_priority(pid: int) -> None:
    numbers = _syscalls()
    if numbers is None:
        return
    get, set_, _ = numbers
    ctypes, libc = _libc()
    theirs = libc.syscall(get, _IOPRIO_WHO_PROCESS, pid)
    mine = libc.syscall(get, _IOPRIO_WHO_PROCESS, 0)
    if theirs < 0 or mine < 0:
        raise OSError(ctypes.get_errno(), "ioprio_get")
    if theirs != mine and libc.syscall(set_, _IOPRIO_WHO_PROCESS, 0, theirs) != 0:
        raise PermissionError(
            f"the process's I/O priority is not permitted to the preloader's child ({os.strerror(ctypes.get_errno())})"
        )


def _check_memory_policy(pid: int) -> None:
    # The process's policy shows in /proc/PID/numa_maps on every mapping without a policy of its own
    # (all of them, this early in an interpreter); a kernel without NUMA has no such file.
    try:
        with open(f"/proc/{pid}/numa_maps") as f:
            text = f.read()
    except FileNotFoundError:
        return
    policies = {line.split(" ", 2)[1] for line in text.splitlines() if line.count(" ") >= 2}
    if policies - {"default"}:
        raise RuntimeError(f"the process has a NUMA memory policy ({', '.join(sorted(policies))}), not the default")
    numbers = _syscalls()
    if numbers is None:
        return
    ctypes, libc = _libc()
    mode = ctypes.c_int(-1)
    if libc.syscall(numbers[2], ctypes.byref(mode), None, 0, None, 0) != 0:
        raise OSError(ctypes.get_errno(), "get_mempolicy")
    if mode.value != 0:  # MPOL_DEFAULT
        raise RuntimeError("the preloader has a NUMA memory policy (numactl) and the process has none")


def _status() -> dict[str, str]:
    fields = {}
    for line in read_proc("/proc/self/status").splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
