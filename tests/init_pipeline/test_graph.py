"""The start-up graph: dependencies, overlap, where stages run, failures, timeouts, spans."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from warmstart.init_pipeline import StageFailed, StartupGraph, call_in_subprocess
from warmstart.metrics import Recorder


def _graph(**kwargs) -> StartupGraph:
    return StartupGraph("test", rank=0, recorder=kwargs.pop("recorder", None) or _null(), **kwargs)


def _null():
    from warmstart.metrics import NullRecorder

    return NullRecorder()


def test_results_reach_dependents_by_name():
    g = _graph()
    g.add("a", lambda: 2)
    g.add("b", lambda a, n: a * n, deps=["a", "n"])
    g.add("c", lambda a, b: a + b, deps=["a", "b"])
    result = g.run({"n": 5})
    assert (result["a"], result["b"], result["c"]) == (2, 10, 12)
    assert result["n"] == 5


def test_order_is_topological_and_keeps_declaration_order_among_ready_stages():
    g = _graph()
    g.add("late", lambda early: 0, deps=["early"])
    g.add("early", lambda: 0)
    g.add("other", lambda: 0)
    assert g.order() == ["early", "late", "other"]


def test_order_is_the_same_whatever_order_stages_become_ready_in():
    # The collectives run in this order on every rank: among ready stages, the first declared goes first.
    g = _graph()
    g.add("pg", lambda: 0)
    g.add("transform", lambda plan, pg: 0, deps=["plan", "pg"])
    g.add("model", lambda: 0)
    g.add("plan", lambda model: 0, deps=["model"])
    g.add("loader", lambda: 0)
    g.add("checkpoint", lambda transform: 0, deps=["transform"])
    assert g.order() == ["pg", "model", "plan", "transform", "loader", "checkpoint"]


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda g: g.add("a", lambda b: 0, deps=["b"]) and g.add("b", lambda a: 0, deps=["a"]),
            r"^the stages (a -> b -> a|b -> a -> b) depend on each other in a cycle \(each on the next\)$",
        ),
        (
            lambda g: (
                g.add("x", lambda: 0)
                and g.add("a", lambda b, x: 0, deps=["b", "x"])
                and g.add("b", lambda c: 0, deps=["c"])
                and g.add("c", lambda a: 0, deps=["a"])
                and g.add("after", lambda a: 0, deps=["a"])
            ),
            r"^the stages a -> b -> c -> a depend on each other in a cycle",
        ),  # only the stages in the cycle
        (lambda g: g.add("a", lambda a: 0, deps=["a"]), r"^the stages a -> a depend on each other in a cycle"),
        (
            lambda g: g.add("a", lambda nope: 0, deps=["nope"]),
            r"^stage 'a' depends on 'nope', which is neither a stage nor an input \(stages: a\)$",
        ),
    ],
)
def test_malformed_graphs_are_refused(build, message):
    g = _graph()
    build(g)
    with pytest.raises(ValueError, match=message):
        g.run()


def test_bad_declarations_are_refused():
    g = _graph()
    g.add("a", lambda: 0)
    with pytest.raises(ValueError, match="declared twice"):
        g.add("a", lambda: 0)
    with pytest.raises(ValueError, match="identifier"):
        g.add("data-loader", lambda: 0)
    with pytest.raises(ValueError, match="runs_on='gpu'"):
        g.add("b", lambda: 0, runs_on="gpu")


def test_independent_thread_stages_run_at_the_same_time():
    # Each stage waits for the other inside a barrier: run one after the other, they would time out.
    barrier = threading.Barrier(3, timeout=10)
    g = _graph()
    for name in ("loader", "plan", "checkpoint_read"):
        g.add(name, lambda: barrier.wait() is not None)
    result = g.run()
    assert all(result[n] for n in ("loader", "plan", "checkpoint_read"))
    spans = [result.timings[n] for n in ("loader", "plan", "checkpoint_read")]
    assert max(s.start for s in spans) < min(s.end for s in spans)


def test_collective_stages_run_on_the_calling_thread_in_declaration_order():
    main = threading.get_ident()
    calls: list[tuple[str, int]] = []
    g = _graph()
    # "slow" finishes after "fast", but the collectives still run in declaration order.
    g.add("slow", lambda: time.sleep(0.2))
    g.add("fast", lambda: None)
    g.add(
        "first_collective", lambda slow: calls.append(("first", threading.get_ident())), deps=["slow"], collective=True
    )
    g.add(
        "second_collective",
        lambda fast: calls.append(("second", threading.get_ident())),
        deps=["fast"],
        collective=True,
    )
    g.add("worker", lambda: threading.get_ident())
    result = g.run()
    assert calls == [("first", main), ("second", main)]
    assert result["worker"] != main
    assert result.timings["first_collective"].runs_on == "main"


def test_process_stage_runs_in_a_child_and_returns_its_result():
    g = _graph()
    g.add("numbers", lambda: list(range(5)))
    g.add("heavy", lambda numbers: (os.getpid(), sum(x * x for x in numbers)), deps=["numbers"], runs_on="process")
    pid, total = g.run()["heavy"]
    assert pid != os.getpid() and total == 30


def test_process_stage_error_is_named():
    def boom():
        raise KeyError("no such table")

    g = _graph()
    g.add("plan", boom, runs_on="process")
    with pytest.raises(StageFailed, match=r"stage 'plan' failed on rank 0: KeyError: 'no such table'"):
        g.run()


def test_call_in_subprocess_reports_a_child_that_dies():
    with pytest.raises(RuntimeError, match="died"):
        call_in_subprocess(os._exit, {"status": 3}, name="planner")
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        call_in_subprocess(lambda: time.sleep(30), timeout_s=0.2)


def test_first_error_names_its_stage_and_stops_dependents():
    ran = []

    def broken():
        raise ValueError("bad batch size")

    g = _graph()
    g.add("data_loader_init", broken)
    g.add("first_batch", lambda data_loader_init: ran.append(1), deps=["data_loader_init"])
    g.add("model_meta", lambda: ran.append(2))
    with pytest.raises(StageFailed) as info:
        g.run()
    assert info.value.stage == "data_loader_init" and info.value.rank == 0
    assert str(info.value) == "start-up stage 'data_loader_init' failed on rank 0: ValueError: bad batch size"
    assert isinstance(info.value.__cause__, ValueError)
    assert 1 not in ran


def test_collective_stage_error_is_named():
    def broken(pg):
        raise RuntimeError("connection reset")

    g = _graph()
    g.add("pg", lambda: "pg", collective=True)
    g.add("model_transform", broken, deps=["pg"], collective=True)
    with pytest.raises(StageFailed, match="'model_transform' failed on rank 0: RuntimeError: connection reset"):
        g.run()


def test_thread_stage_timeout_fails_the_graph():
    release, finished = threading.Event(), threading.Event()

    def stuck():
        release.wait(30)
        finished.set()

    g = _graph()
    g.add("stuck", stuck, timeout_s=0.3)
    with pytest.raises(StageFailed, match="'stuck' failed on rank 0: TimeoutError: still running after 0.3 s"):
        g.run()
    assert not finished.is_set()  # the graph failed without waiting for the stuck thread
    release.set()


def test_peer_failure_on_the_channel_fails_this_rank_naming_the_peer_stage():
    import torch.distributed as dist
    from _redis import free_port

    from warmstart.init_pipeline import StoreFailureChannel

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    peer = StoreFailureChannel(store=store, name="startup")
    here = StoreFailureChannel(store=store, name="startup")
    g = StartupGraph("startup", rank=0, recorder=_null(), channel=here)
    g.add("data_loader_init", lambda: time.sleep(30))
    g.add(
        "model_meta",
        lambda: peer.publish(json.dumps({"stage": "sharding_plan", "rank": 1, "reason": "OSError: disk full"})),
    )
    with pytest.raises(StageFailed) as info:
        g.run()
    assert (info.value.stage, info.value.rank, info.value.seen_on) == ("sharding_plan", 1, 0)
    assert "failed on rank 1 (seen on rank 0): OSError: disk full" in str(info.value)


def test_the_failing_rank_raises_before_the_peers_that_heard_of_it():
    """Launchers kill every rank once one exits: the failing rank must be the first to raise, so
    that its own error and traceback come out, not a peer's report of it."""
    import torch.distributed as dist
    from _redis import free_port

    from warmstart.init_pipeline import StoreFailureChannel

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    raised: list[int] = []
    release = threading.Event()

    def rank(r: int) -> None:
        g = StartupGraph("startup", rank=r, recorder=_null(), channel=StoreFailureChannel(store=store, name="s"))
        if r == 1:
            g.add("data_loader_init", lambda: 1 / 0)
        else:  # waits for its own slow stage, in no collective: it hears of rank 1's failure at once
            g.add("data_loader_init", lambda: release.wait(30))
        with contextlib.suppress(StageFailed):
            g.run()
        raised.append(r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    release.set()
    assert raised == [1, 0]


def test_local_failure_is_published_for_the_peers():
    import torch.distributed as dist
    from _redis import free_port

    from warmstart.init_pipeline import StoreFailureChannel

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    g = StartupGraph("startup", rank=3, recorder=_null(), channel=StoreFailureChannel(store=store, name="startup"))
    g.add("checkpoint_load", lambda: 1 / 0)
    with pytest.raises(StageFailed):
        g.run()
    seen = json.loads(StoreFailureChannel(store=store, name="startup").poll())
    assert seen == {"stage": "checkpoint_load", "rank": 3, "reason": "ZeroDivisionError: division by zero"}


def test_rank_stuck_in_a_collective_after_a_failure_is_aborted(tmp_path):
    # The main thread blocks (as in a collective whose peer is gone) while a thread stage fails:
    # the watchdog must end the process within the grace period, naming the failed stage.
    script = textwrap.dedent("""
        import time
        from warmstart.init_pipeline import StartupGraph
        from warmstart.metrics import NullRecorder
        g = StartupGraph("startup", rank=1, recorder=NullRecorder(), abort_grace_s=0.5)
        def broken():
            time.sleep(0.2)
            raise OSError("loader worker died")
        g.add("data_loader_init", broken)
        g.add("all_reduce", lambda: time.sleep(60), collective=True)
        g.run()
    """)
    # timeout: a hang guard, not a speed check (unaborted, the collective stage sleeps past it).
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert (
        "start-up stage 'data_loader_init' failed on rank 1: OSError: loader worker died; aborting rank 1, "
        "which is stuck in collective stage 'all_reduce'"
    ) in proc.stderr
    # its own error cannot be raised: its traceback is printed instead, as the interpreter would
    traceback = r"Traceback \(most recent call last\):\n(.+\n)+.*, in broken\nOSError: loader worker died"
    assert re.search(traceback, proc.stderr), proc.stderr


def test_collective_past_its_timeout_aborts(tmp_path):
    script = textwrap.dedent("""
        import time
        from warmstart.init_pipeline import StartupGraph
        from warmstart.metrics import NullRecorder
        g = StartupGraph("startup", rank=0, recorder=NullRecorder(), collective_timeout_s=0.3, abort_grace_s=0.2)
        g.add("process_group_init", lambda: time.sleep(60), collective=True)
        g.run()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "stage 'process_group_init' failed on rank 0: TimeoutError: still running after 0.3 s" in proc.stderr


def test_every_stage_is_a_span(tmp_path):
    rec = Recorder(tmp_path, job="j", rank=0, attempt=0, flush_interval_s=0)
    g = _graph(recorder=rec)
    g.add("data_loader_init", lambda: None)
    g.add("sharding_plan", lambda: None, runs_on="process")
    g.add("warm_caches", lambda: None, bucket="compile", collective=True)
    g.run()
    rec.close()
    events = [json.loads(line) for line in rec.path.read_text().splitlines()]
    spans = {(e["event"], e["span"], e.get("bucket")) for e in events}
    for name, bucket in (("data_loader_init", None), ("sharding_plan", None), ("warm_caches", "compile")):
        assert ("begin", name, bucket) in spans and ("end", name, bucket) in spans


def test_critical_path_and_sequential_time():
    g = _graph()
    g.add("a", lambda: time.sleep(0.05))
    g.add("b", lambda: time.sleep(0.3))
    g.add("c", lambda a: time.sleep(0.05), deps=["a"])
    g.add("d", lambda b, c: None, deps=["b", "c"])
    result = g.run()
    path, total = result.critical_path()
    assert path == ["b", "d"]
    assert total == pytest.approx(result.timings["b"].seconds + result.timings["d"].seconds)
    assert result.sequential_s == pytest.approx(sum(t.seconds for t in result.timings.values()))
    assert result.wall_s >= total


def test_first_stages_run_before_any_other_stage_starts():
    """A stage that forks (a data loader's workers) must do so while no other thread exists."""
    g = _graph()
    seen: list[tuple[str, list[str]]] = []

    def stage_threads() -> list[str]:  # the graph names the threads it starts: its stages' and its watchdog
        ours = {"warmstart-stage-model", "warmstart-stage-prefetch", "warmstart-test-watchdog"}
        return [t.name for t in threading.enumerate() if t.name in ours]

    # the model stage lasts a while: had it started before the fork, its thread would still be alive
    g.add("model", lambda: seen.append(("model", stage_threads())) or time.sleep(0.3))
    g.add(
        "fork_workers",
        lambda: (time.sleep(0.1), seen.append(("fork_workers", stage_threads())))[1] or "it",
        runs_on="first",
    )
    g.add("prefetch", lambda fork_workers: fork_workers + "!", deps=["fork_workers"])
    result = g.run()
    assert seen[0] == ("fork_workers", [])  # no thread of the graph existed yet, not even its watchdog
    assert seen[1][0] == "model" and "warmstart-stage-model" in seen[1][1]  # then stages get their threads
    assert result["prefetch"] == "it!" and result.timings["fork_workers"].runs_on == "first"


def test_a_first_stage_may_depend_only_on_inputs():
    g = _graph()
    g.add("a", lambda: 1)
    g.add("b", lambda a, x: a + x, deps=["a", "x"], runs_on="first")
    with pytest.raises(ValueError, match="'b' runs first but depends on the stages a"):
        g.run(inputs={"x": 1})
    g2 = _graph()
    g2.add("b", lambda x: x + 1, deps=["x"], runs_on="first")
    assert g2.run(inputs={"x": 1})["b"] == 2
