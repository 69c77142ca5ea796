"""Fixtures for the checkpoint tests: real full and read-only file systems.

A full disk is a tiny tmpfs mount when this process may mount (root with CAP_SYS_ADMIN), else a
file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) applied to the processes that write; either way the
writes fail in the kernel (ENOSPC or EFBIG), as on a real full volume. A read-only directory is a
read-only tmpfs mount as root, or a mode-0555 directory for other users (root ignores modes).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _mount_tmpfs(target: Path, options: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=10)


@dataclass
class FullDisk:
    """A checkpoint directory on which writes beyond ``limit_bytes`` fail."""

    path: Path
    limit_bytes: int
    kind: str  # "tmpfs" (ENOSPC) or "rlimit" (EFBIG)

    def preexec(self) -> Callable[[], None] | None:
        """For subprocess.Popen(preexec_fn=...): applies the file-size limit in the child."""
        if self.kind != "rlimit":
            return None
        limit = self.limit_bytes

        def apply() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        return apply

    @property
    def errno_text(self) -> str:
        return "No space left on device" if self.kind == "tmpfs" else "File too large"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[FullDisk]:
    """A 2 MiB volume (or a 2 MiB per-file limit where mounting is not permitted)."""
    target = tmp_path / "full"
    limit = 2 * 1024 * 1024
    if _mount_tmpfs(target, f"size={limit}"):
        try:
            yield FullDisk(target, limit, "tmpfs")
        finally:
            _umount(target)
    else:
        yield FullDisk(target, limit, "rlimit")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody in this process can create files in."""
    target = tmp_path / "ro"
    if os.geteuid() != 0:
        target.mkdir()
        target.chmod(0o555)
        yield target
        target.chmod(0o755)
    elif _mount_tmpfs(target, "ro,size=64k"):
        try:
            yield target
        finally:
            _umount(target)
    else:
        pytest.skip("running as root without permission to mount: no way to make a directory read-only")
