"""What a preloader notices of the files its imports came from: real files, real inotify, real
renames, links and a real queue overflow; polling where notifications are not trusted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from warmstart.preload.watch import (
    LOCAL_FILESYSTEMS,
    ImportedFiles,
    filesystem_of,
    filesystem_types,
    importable_entries,
    stamp,
)

NEVER = float("inf")  # a max_age_s that never polls: only notifications can tell


def _watch(files: list[Path], path_dirs: list[Path] = (), **kwargs) -> ImportedFiles:
    # notifications are what these tests are about, whatever filesystem holds the test directories
    kwargs.setdefault("is_local", lambda directory: True)
    return ImportedFiles(
        {str(f): stamp(str(f)) for f in files},
        {str(d): importable_entries(str(d)) for d in path_dirs},
        **kwargs,
    )


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "layers.py").write_text("WIDTH = 8\n")
    (root / "helpers.py").write_text("")
    return root


def test_a_local_filesystem_is_watched_and_a_network_one_polled(tmp_path):
    kind = filesystem_of(str(tmp_path), filesystem_types())
    if kind not in LOCAL_FILESYSTEMS:
        pytest.skip(f"the test directory is on {kind}")
    watch = ImportedFiles({str(tmp_path): stamp(str(tmp_path))}, {})
    assert watch.describe()["watched_directories"] >= 1
    assert watch.describe()["polled_files"] == 0
    watch.close()
    assert filesystem_of("/proc/self", filesystem_types()) == "proc"  # the longest mount point wins
    nfs = {"/": "ext4", "/mnt/data": "nfs4"}
    assert filesystem_of("/mnt/data/venv/lib", nfs) == "nfs4" and filesystem_of("/mnt/database", nfs) == "ext4"


def test_an_edit_is_known_at_the_next_call_without_polling(project):
    layers = project / "pkg" / "layers.py"
    watch = _watch([layers, project / "pkg" / "__init__.py"], [project])
    try:
        assert watch.changed(NEVER) is None
        (project / "run.log").write_text("step 1\n")  # a job's log in its project root
        (project / "warmstart-runs").mkdir()
        assert watch.changed(NEVER) is None
        layers.write_text("WIDTH = 16\n")
        assert watch.changed(NEVER) == str(layers)
        assert watch.describe()["full_checks"] == 1  # the one made when the watches were set
    finally:
        watch.close()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p: _replace(p / "pkg" / "layers.py", "W = 1\n"), id="replaced-by-rename"),
        pytest.param(lambda p: (p / "pkg" / "layers.py").unlink(), id="deleted"),
        pytest.param(lambda p: os.utime(p / "pkg" / "layers.py", ns=(1, 1)), id="touched"),
        pytest.param(lambda p: (p / "torchrec_extras.py").write_text(""), id="new-module-on-sys-path"),
        pytest.param(lambda p: (p / "extra.pth").write_text(""), id="new-pth-on-sys-path"),
        pytest.param(lambda p: (p / "pkg").rename(p / "pkg_old"), id="directory-moved"),
    ],
)
def test_every_kind_of_change_is_notified(project, change):
    watch = _watch([project / "pkg" / "layers.py"], [project])
    try:
        change(project)
        assert watch.changed(NEVER) is not None
    finally:
        watch.close()


def test_a_change_before_the_watches_existed_is_found(project):
    # The preloader stamps its files when it has imported them, and watches them later.
    layers = project / "pkg" / "layers.py"
    stamps = {str(layers): stamp(str(layers))}
    layers.write_text("WIDTH = 9\n")
    watch = ImportedFiles(stamps, {}, is_local=lambda directory: True)
    try:
        assert watch.changed(NEVER) == str(layers)
    finally:
        watch.close()


def test_a_file_reached_through_a_link_is_watched_where_it_lies(tmp_path, project):
    site = tmp_path / "site"
    site.mkdir()
    (site / "layers.py").symlink_to(project / "pkg" / "layers.py")
    watch = _watch([site / "layers.py"])
    try:
        (project / "pkg" / "layers.py").write_text("WIDTH = 32\n")
        assert watch.changed(NEVER) == str(site / "layers.py")
    finally:
        watch.close()


def test_a_directory_reached_by_two_paths_is_one_watch_that_covers_both(tmp_path, project):
    # sys.path holding a linked directory beside its target: the kernel gives both one watch
    site = tmp_path / "site"
    site.mkdir()
    (site / "pkg").symlink_to(project / "pkg", target_is_directory=True)
    layers, init = site / "pkg" / "layers.py", project / "pkg" / "__init__.py"
    for edited in (layers, init):
        watch = _watch([init, layers])  # the target first, then the path through the link
        try:
            assert watch.describe()["watched_directories"] == 1
            edited.write_text("# edited\n")
            assert watch.changed(NEVER) == str(edited)
        finally:
            watch.close()
    # the linked path is on sys.path, and a module appears in what it points at
    watch = _watch([init], [site / "pkg"])
    try:
        (project / "pkg" / "extra_layers.py").write_text("")
        assert watch.changed(NEVER) == str(site / "pkg")
    finally:
        watch.close()


def test_a_stamped_directory_changes_with_its_entries(project):
    # torch's source hash reads directory listings: a new module under torch/ changes it
    pkg = project / "pkg"
    watch = _watch([pkg, pkg / "layers.py"])
    try:
        (pkg / "not_a_module.txt").write_text("")
        assert watch.changed(NEVER) == str(pkg)
    finally:
        watch.close()


def test_a_lost_notification_means_checking_everything(project):
    # The kernel queues 16,384 notifications by default (fs.inotify.max_queued_events); more, unread,
    # and it drops the rest, the edit's among them, with one overflow notification.
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 100_000:
        pytest.skip(f"fs.inotify.max_queued_events is {limit}: too many files to overflow it")
    layers = project / "pkg" / "layers.py"
    watch = _watch([layers])
    try:
        for i in range(limit + 10):
            (project / "pkg" / f"n{i}").touch()  # distinct names: the kernel cannot merge them
        layers.write_text("WIDTH = 64\n")
        assert watch.changed(NEVER) == str(layers)
        assert watch.describe()["full_checks"] == 2
    finally:
        watch.close()


def test_a_network_filesystem_is_polled_and_notifications_do_not_count_there(project):
    layers = project / "pkg" / "layers.py"
    watch = _watch([layers], [project], is_local=lambda directory: False)
    try:
        assert watch.fileno() is not None  # notifications exist, yet nothing is watched through them
        assert watch.describe() == {
            "watched_directories": 0,
            "polled_files": 1,
            "polled_directories": 1,
            "full_checks": 1,
        }
        assert watch.changed(0.0) is None
        layers.write_text("WIDTH = 128\n")
        assert watch.changed(NEVER) is None  # checked less than forever ago
        assert watch.changed(0.0) == str(layers)
    finally:
        watch.close()


def test_a_change_is_kept_and_the_queue_still_emptied(project):
    layers = project / "pkg" / "layers.py"
    watch = _watch([layers], [project])
    try:
        layers.write_text("WIDTH = 1\n")
        assert watch.changed(NEVER) == str(layers)
        layers.write_text("WIDTH = 8\n")  # the same size and content again: still a different file
        (project / "more.py").write_text("")
        assert watch.changed(NEVER) == str(layers)
        fd = watch.fileno()
        assert fd is not None
        assert not _readable(fd)  # nothing left to read: the queue cannot fill up and overflow
    finally:
        watch.close()


def _replace(path: Path, text: str) -> None:
    """As editors and installers write a file: a new one, renamed over the old."""
    new = path.with_suffix(".tmp")
    new.write_text(text)
    new.rename(path)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def test_a_notification_descriptor_that_fails_means_polling_and_one_full_check(project):
    # The descriptor stops being inotify's (here: /dev/null put in its place): reading it fails, the
    # watch falls back to polling everything, and a change made meanwhile is found.
    layers = project / "pkg" / "layers.py"
    watch = _watch([layers], [project])
    try:
        fd = watch.fileno()
        assert fd is not None
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, fd)
        os.close(null)
        layers.write_text("WIDTH = 3\n")
        assert watch.changed(NEVER) == str(layers)
        assert watch.fileno() is None
        assert watch.describe()["watched_directories"] == 0 and watch.describe()["polled_files"] == 1
    finally:
        watch.close()
