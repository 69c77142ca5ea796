"""Ready-made start-up stages for a TorchRec training job, wired into a :class:`StartupGraph`.

:func:`torchrec_startup_graph` turns a :class:`TorchRecStartup` (the job's callables: model
builder, data loader builder, planner, checkpoint hook, compile warm-up) into this graph::

    process_group_init (main) ───────────────────────┐
    model_meta (thread) ─> sharding_plan (thread; rank 0: cache or planner in a subprocess)
                               └─> sharding_plan_broadcast (main) ─> model_transform (main: DMP)
                                                  └─> optimizer_init (main) ─> checkpoint_load (main: hook)
    data_loader_start (first: build, iter() forks the workers before any thread exists)
        └─> data_loader_init (thread: first batches prefetched)
    compile_warmup (thread: torch.compile of the dense part on a synthetic batch)

Rank 0 resolves the plan while every rank still waits in the rendezvous; the loader's workers boot
and the dense part compiles while the model is planned, sharded and loaded. Collectives (the
rendezvous, the plan broadcast, DistributedModelParallel, the checkpoint hook) run on the main
thread in that order on every rank. :class:`StoreFailureChannel` tells the other ranks when a stage
fails, through torch's TCPStore. :func:`release_process_groups` ends a job: it frees the process
groups (and joins their gloo threads) before the interpreter exits. This module owns the TorchRec
specifics; scheduling is ``graph.py``.

Example:
    >>> spec = TorchRecStartup(build_model=lambda device: DLRM(..., device=device),  # doctest: +SKIP
    ...                        build_loader=lambda rank, world: DataLoader(...), batch_size=512)
    >>> result = torchrec_startup_graph(spec).run()                                  # doctest: +SKIP
    >>> model, batches = result["model_transform"], result["data_loader_init"]       # doctest: +SKIP
    >>> del result, model, batches; release_process_groups()   # at the end of the job # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data
from torch import nn

from warmstart import torch_internals
from warmstart.init_pipeline.generators import GeneratorGuard, undone_except_compiles
from warmstart.init_pipeline.graph import StartupGraph
from warmstart.init_pipeline.plan_cache import PlanOutcome, broadcast_plan, resolve_plan

log = logging.getLogger("warmstart.init_pipeline")

_CONNECT_RETRY_S = 1.0  # how often a channel without a store tries to reach one again
_LISTEN_POLL_S = 0.01  # how often a rank looks for rank 0's store before joining the rendezvous
_LISTEN_WAIT_MAX_S = 30.0  # after this, the rendezvous goes on as torch's own (its retries, its timeout)


class StoreFailureChannel:
    """A :class:`~warmstart.init_pipeline.graph.FailureChannel` over torch's c10d store.

    The first failure published wins; every rank sees that one. Under torchrun the store is the
    agent's (``TORCHELASTIC_USE_AGENT_STORE``), reachable before the process group exists; otherwise
    it is the default process group's store once ``init_process_group`` has returned (a failure
    published earlier is kept and sent then).

    Args:
        store: a ``torch.distributed.Store``; default: found as described above.
        name: the graph's name (keys are per graph and per attempt).
        attempt: restart count; default ``TORCHELASTIC_RESTART_COUNT``, else 0.
    """

    def __init__(self, store: Any = None, *, name: str = "startup", attempt: int | None = None) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        self._store = store
        self._key = f"warmstart/{name}/attempt-{attempt}/failed"
        self._pending: str | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def publish(self, message: str) -> None:
        store = self._resolve()
        if store is None:
            self._pending = message
            return
        try:
            store.compare_set(self._key, "", message)  # only the first failure is kept
        except Exception:  # noqa: BLE001 - a channel never raises; the collective timeout still holds
            log.warning("warmstart: could not publish the start-up failure to the other ranks", exc_info=True)

    def poll(self) -> str | None:
        store = self._resolve()
        if store is None:
            return None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.publish(pending)
        try:
            if store.check([self._key]):
                return store.get(self._key).decode()
        except Exception:  # noqa: BLE001
            log.debug("warmstart: failure channel poll failed", exc_info=True)
        return None

    def _resolve(self) -> Any:
        with self._lock:
            if self._store is not None or time.monotonic() < self._next_try:
                return self._store
            self._next_try = time.monotonic() + _CONNECT_RETRY_S
            try:
                env = os.environ
                if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR"):
                    self._store = dist.TCPStore(
                        env["MASTER_ADDR"],
                        int(env["MASTER_PORT"]),
                        is_master=False,
                        timeout=timedelta(seconds=5),
                        wait_for_workers=False,
                    )
                elif dist.is_available() and dist.is_initialized():
                    self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001
                log.debug("warmstart: no store for the failure channel yet", exc_info=True)
            return self._store


class PrefetchedLoader:
    """An iterator over a data loader whose first batches were fetched during start-up.

    The ``data_loader_start`` stage builds the loader and calls ``iter(loader)``, which forks its
    workers, before any other stage starts; the ``data_loader_init`` stage fetches the first
    ``prefetch`` batches (pass the started ``iterator``); iteration then yields those batches and
    continues from the same iterator.

    Attributes:
        loader: the data loader (for ``state_dict`` and the like).
        prefetched: how many batches were fetched ahead.
    """

    def __init__(self, loader: Iterable[Any], prefetch: int = 3, iterator: Iterator[Any] | None = None) -> None:
        self.loader = loader
        self._it: Iterator[Any] = iter(loader) if iterator is None else iterator
        self._ready: deque[Any] = deque()
        for _ in range(prefetch):
            try:
                self._ready.append(next(self._it))
            except StopIteration:
                break
        self.prefetched = len(self._ready)

    def __iter__(self) -> PrefetchedLoader:
        return self

    def __next__(self) -> Any:
        if self._ready:
            return self._ready.popleft()
        return next(self._it)


@dataclasses.dataclass
class CompileWarmup:
    """Compile the dense part on a synthetic batch while the rest of start-up runs.

    ``build(device)`` must return a module of the same class, shapes and dtypes as the one the
    training step compiles, ``example_inputs(device)`` tensors of the same shapes, dtypes, devices
    and ``requires_grad`` as the real inputs (e.g. pooled embeddings require grad), and the step
    must compile the module with the same ``compile_kwargs``: TorchDynamo's guards then accept the
    real module and inputs and the step reuses the compiled code (and on another process,
    Inductor's caches and warmstart's store serve it). The warm-up module is a
    separate instance, so its forward and backward never touch the model's weights, buffers or
    gradients.

    The warm-up runs in a thread beside the model's build, the tables' initialization and the
    checkpoint's load, which draw from (or restore) torch's global random generators. In the
    start-up graph, whatever the warm-up draws (``build``'s default initialization, random
    ``example_inputs``, a dropout in the compiled forward, eager code between compiled graphs) is
    undone and never interleaved with those stages
    (:class:`~warmstart.init_pipeline.generators.GeneratorGuard`), so the model's weights and the
    random stream training starts or resumes with are those of a start without it; only the compiles
    run beside them. :func:`zero_initialized` saves the time of initializing weights nobody
    reads.

    Attributes:
        build: builds the module to compile on the given device.
        example_inputs: builds a synthetic batch (positional arguments) on the given device.
        backward: also compile the backward pass (``sum`` of the outputs as the loss). Not run when
            the forward loaded every graph from AOTAutograd's cache (a warm start): each entry
            brings its backward, already compiled, and running it would only compute.
        compile_kwargs: keyword arguments of ``torch.compile``.
        compile_module: how the step compiles the module, when it is not ``torch.compile(module,
            **compile_kwargs)``: e.g. regional compilation, compiling some submodules on their own
            (``lambda m: m.compile_regions() or m``). Returns what to call.
    """

    build: Callable[[torch.device], nn.Module]
    example_inputs: Callable[[torch.device], Sequence[Any]]
    backward: bool = True
    compile_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile_module: Callable[[nn.Module], Callable[..., Any]] | None = None

    def run(self, device: torch.device, *, generators: GeneratorGuard | None = None) -> float:
        """Compile and run once; return the seconds it took.

        With ``generators`` (the start-up graph passes its own), what ``build``, ``example_inputs``,
        the forward and the backward draw from torch's random generators is undone, and never
        interleaved with the draws of the stages that hold the guard; only the compiles run beside
        those stages.
        """
        start = time.perf_counter()
        with undone_except_compiles(generators) if generators is not None else contextlib.nullcontext():
            module = self.build(device)
            inputs = self.example_inputs(device)
            if self.compile_module is not None:
                compiled = self.compile_module(module)
            else:
                compiled = torch.compile(module, **self.compile_kwargs)
            before = _aot_autograd_counts()
            out = compiled(*inputs)
            if self.backward and not _all_loaded_from_cache(before):
                tensors = [
                    t
                    for t in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if tensors:
                    torch.stack([t.float().sum() for t in tensors]).sum().backward()
        return time.perf_counter() - start


def zero_initialized(build: Callable[[torch.device], nn.Module]) -> Callable[[torch.device], nn.Module]:
    """``build`` for :class:`CompileWarmup` that draws nothing from torch's global random generator.

    The returned callable runs ``build(meta)`` with the meta device as default (modules whose
    constructor ignores the argument are built there too, without initialization), gives the
    module memory on the requested device with ``to_empty`` and fills every parameter and buffer
    with zeros: the compile does not depend on values, and ``to_empty`` leaves garbage that an
    index buffer (TorchRec's ``InteractionArch``) must not hold.
    """

    def build_zeroed(device: torch.device) -> nn.Module:
        meta = torch.device("meta")
        with meta:
            module = build(meta)
        module = module.to_empty(device=device)
        with torch.no_grad():
            for tensor in (*module.parameters(), *module.buffers()):
                tensor.zero_()
        return module

    return build_zeroed


def _aot_autograd_counts() -> dict[str, int]:
    counters = torch_internals.resolve("dynamo_counters")
    return dict(counters["aot_autograd"]) if counters is not None else {}


def _all_loaded_from_cache(before: dict[str, int]) -> bool:
    """Whether every graph compiled since ``before`` (AOTAutograd's counters) came from its cache."""
    after = _aot_autograd_counts()
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    hits = delta.get("autograd_cache_hit", 0)
    return hits > 0 and hits == delta.get("total", 0) and not any(delta.get(name, 0) for name in _NOT_LOADED)


#: AOTAutograd's counters of graphs it compiled rather than loaded, or could not cache.
_NOT_LOADED = ("autograd_cache_miss", "autograd_cache_bypass", "autograd_cache_guard_miss", "not_ok")


@dataclasses.dataclass
class TorchRecStartup:
    """What a TorchRec job tells :func:`torchrec_startup_graph`.

    Attributes:
        build_model: builds the unsharded model on the device it is given (``meta`` here).
        batch_size: per-rank batch size (the planner's input and a cache-key field).
        sharders: the sharders; default TorchRec's ``get_default_sharders()``.
        build_planner: ``(world_size, local_world_size, compute_device) -> planner``; default an
            ``EmbeddingShardingPlanner`` over ``Topology(world_size, compute_device,
            local_world_size=...)`` with ``batch_size``.
        build_loader: ``(rank, world_size) -> iterable of batches``; ``None``: no loader stage.
        prefetch_batches: batches fetched during start-up (TorchRec's pipeline needs 3 to start), by
            a ``DataLoader`` with worker processes; a loader that makes its batches in this process
            fetches none ahead (its random transforms would draw beside the model's initialization).
        build_optimizer: ``(model) -> optimizer`` for the parameters the sharders do not fuse, built
            after sharding; ``None``: no stage.
        load_checkpoint: ``(model, optimizer) -> anything``, called after sharding with the
            ``DistributedModelParallel`` model and the optimizer (``None`` without
            ``build_optimizer``); a collective: every rank calls it. ``None``: no stage. Restore the
            data loader's state in ``build_loader`` instead, before its first batch is fetched.
        compile_warmup: see :class:`CompileWarmup`; ``None``: no stage.
        device: the training device (``cpu`` or ``cuda``); the planner's compute device is its type.
        backend: the process group backend.
        pg_timeout_s: timeout of the process group's collectives, and of each main-thread stage.
        plan_store: the store for sharding plans; default ``warmstart.compile_cache.get_store()``.
        plan_in_subprocess: on a cache miss, rank 0 plans in a forked child (keeps the GIL free for
            the other stages).
        output_dtensor: build ``ShardingEnv(..., output_dtensor=True)`` (DTensor state dicts, which
            DCP's async staging supports).
        dmp_kwargs: further keyword arguments of ``DistributedModelParallel``.
    """

    build_model: Callable[[torch.device], nn.Module]
    batch_size: int
    sharders: list[Any] | None = None
    build_planner: Callable[[int, int, str], Any] | None = None
    build_loader: Callable[[int, int], Iterable[Any]] | None = None
    prefetch_batches: int = 3
    build_optimizer: Callable[[nn.Module], Any] | None = None
    load_checkpoint: Callable[[nn.Module, Any], Any] | None = None
    compile_warmup: CompileWarmup | None = None
    device: torch.device | str = "cpu"
    backend: str = "gloo"
    pg_timeout_s: float = 600.0
    plan_store: Any = None
    plan_in_subprocess: bool = True
    output_dtensor: bool = True
    dmp_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def _wait_for_rank0_store(env: Any, timeout_s: float) -> bool:
    """Before an ``env://`` rendezvous whose store rank 0 starts (``MASTER_ADDR``/``MASTER_PORT``, no
    torchrun agent store), wait until that store listens, looking every 10 ms.

    A rank that reaches the store first is refused and torch's client then sleeps 0.5-1.5 s (its
    back-off) before trying again, however soon the store listens: ranks forked together from a
    preloader, or started in lock step, can lose that second at any start. Returns whether the store
    listened within ``timeout_s``; either way the rendezvous that follows is torch's own.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return True  # the agent's store listened before this rank was started
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return False  # not an env:// rendezvous: nothing to wait for here
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=max(0.05, min(1.0, timeout_s))):
                return True
        except OSError:
            if time.monotonic() + _LISTEN_POLL_S >= deadline:
                return False
            time.sleep(_LISTEN_POLL_S)


def _topology(rank: int | None, world_size: int | None, local_world_size: int | None) -> tuple[int, int, int]:
    """The rank, world size and local world size given, or else torchrun's (``RANK``...)."""
    env = os.environ
    rank = int(env.get("RANK", "0")) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if local_world_size is None:
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    return rank, world_size, local_world_size


def torchrec_startup_graph(
    spec: TorchRecStartup,
    *,
    name: str = "startup",
    rank: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    **graph_kwargs: Any,
) -> StartupGraph:
    """Build the TorchRec start-up graph (see the module docstring); add stages of your own, then ``run()``.

    Stage results: ``process_group_init`` (the process group), ``data_loader_init``
    (:class:`PrefetchedLoader`), ``model_meta`` (the unsharded model), ``sharding_plan`` (rank 0: a
    :class:`~warmstart.init_pipeline.plan_cache.PlanOutcome`; others ``None``),
    ``sharding_plan_broadcast`` (the ``ShardingPlan``), ``model_transform`` (the
    ``DistributedModelParallel``), ``optimizer_init`` (the optimizer), ``checkpoint_load`` (the
    hook's return value), ``compile_warmup`` (seconds).

    Args:
        spec: the job's parts.
        name: the graph's name.
        rank, world_size, local_world_size: default ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
            from the environment (torchrun sets them).
        graph_kwargs: passed to :class:`StartupGraph` (``recorder``, ``abort_grace_s``...);
            ``channel`` defaults to a :class:`StoreFailureChannel` when ``world_size > 1``.

    Returns:
        The graph, not yet run.
    """
    env = os.environ
    rank, world_size, local_world_size = _topology(rank, world_size, local_world_size)
    device = torch.device(spec.device)
    if world_size > 1:
        graph_kwargs.setdefault("channel", StoreFailureChannel(name=name))
    graph_kwargs.setdefault("collective_timeout_s", spec.pg_timeout_s)
    graph = StartupGraph(name, rank=rank, **graph_kwargs)
    sharders = spec.sharders
    if sharders is None:
        from torchrec.distributed.sharding_plan import get_default_sharders

        sharders = get_default_sharders()

    def process_group_init() -> dist.ProcessGroup:
        if not dist.is_initialized():
            if rank != 0:
                _wait_for_rank0_store(env, min(spec.pg_timeout_s, _LISTEN_WAIT_MAX_S))
            dist.init_process_group(backend=spec.backend, timeout=timedelta(seconds=spec.pg_timeout_s))
        if device.type == "cuda":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        world = dist.group.WORLD
        if world is None:  # None only before init_process_group, which has run by now
            raise RuntimeError("torch.distributed is initialized but has no default process group")
        return world

    # The stages that draw from torch's random generators (initialization) or set them (a checkpoint's
    # load) hold this while the compile warm-up's draws wait and are undone.
    generators = GeneratorGuard(device)

    def model_meta() -> nn.Module:
        with generators.exclusive():
            return spec.build_model(torch.device("meta"))

    def sharding_plan(model_meta: nn.Module) -> PlanOutcome | None:
        if rank != 0:
            return None  # only rank 0 looks up or plans; the others get the plan from the broadcast
        planner = (spec.build_planner or _default_planner(spec.batch_size))(world_size, local_world_size, device.type)
        store = spec.plan_store
        if store is None:
            from warmstart.compile_cache import get_store

            store = get_store()
        outcome = resolve_plan(
            planner, model_meta, sharders, store=store, plan_in_subprocess=spec.plan_in_subprocess, catch=True
        )
        log.info("warmstart: sharding plan from %s in %.3f s", outcome.source, outcome.seconds)
        return outcome

    def sharding_plan_broadcast(sharding_plan: PlanOutcome | None, process_group_init: dist.ProcessGroup) -> Any:
        return broadcast_plan(sharding_plan, process_group_init)

    def model_transform(
        model_meta: nn.Module, sharding_plan_broadcast: Any, process_group_init: dist.ProcessGroup
    ) -> nn.Module:
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        pg = process_group_init
        sharding_env = ShardingEnv(dist.get_world_size(pg), dist.get_rank(pg), pg, output_dtensor=spec.output_dtensor)
        with generators.exclusive():  # the tables are initialized here
            return DistributedModelParallel(
                module=model_meta,
                env=sharding_env,
                device=device,
                plan=sharding_plan_broadcast,
                sharders=sharders,
                **spec.dmp_kwargs,
            )

    graph.add("process_group_init", process_group_init, collective=True)
    graph.add("model_meta", model_meta, bucket="model_transform")
    graph.add("sharding_plan", sharding_plan, deps=["model_meta"])
    if spec.build_loader is not None:
        build_loader, prefetch = spec.build_loader, spec.prefetch_batches

        # The workers fork in a 'first' stage, before any stage thread exists: a fork while another
        # thread holds one of torch's locks (the RNG's, while a thread builds a module) leaves a
        # worker deadlocked. The first batches are then fetched in a thread with everything else.
        def data_loader_start() -> tuple[Iterable[Any], Iterator[Any]]:
            loader = build_loader(rank, world_size)
            return loader, iter(loader)

        # Only a loader whose worker processes make the batches fetches ahead: one that makes them in
        # this process may draw from torch's global generators (random transforms), which beside the
        # stages that initialize the model and restore the checkpoint's generators would interleave
        # with them from run to run. Its first batch comes in the training loop, after them, as in
        # plain code.
        def data_loader_init(data_loader_start: tuple[Iterable[Any], Iterator[Any]]) -> PrefetchedLoader:
            loader, iterator = data_loader_start
            return PrefetchedLoader(loader, prefetch if _fetches_in_workers(loader) else 0, iterator=iterator)

        graph.add("data_loader_start", data_loader_start, runs_on="first", bucket="data_loader_init")
        graph.add("data_loader_init", data_loader_init, deps=["data_loader_start"])
    if spec.compile_warmup is not None:
        warmup = spec.compile_warmup
        graph.add("compile_warmup", lambda: warmup.run(device, generators=generators), bucket="compile")
    graph.add(
        "sharding_plan_broadcast",
        sharding_plan_broadcast,
        deps=["sharding_plan", "process_group_init"],
        collective=True,
        bucket="sharding_plan",
    )
    graph.add(
        "model_transform",
        model_transform,
        deps=["model_meta", "sharding_plan_broadcast", "process_group_init"],
        collective=True,
    )
    if spec.build_optimizer is not None:
        build_optimizer = spec.build_optimizer
        # On the main thread: it reads the parameters DistributedModelParallel just built.
        graph.add(
            "optimizer_init",
            lambda model_transform: _exclusive(generators, build_optimizer, model_transform),
            deps=["model_transform"],
            runs_on="main",
            bucket="model_transform",
        )
    if spec.load_checkpoint is not None:
        _add_checkpoint_load(graph, spec.load_checkpoint, generators, with_optimizer=spec.build_optimizer is not None)
    return graph


def _add_checkpoint_load(
    graph: StartupGraph, hook: Callable[..., Any], generators: GeneratorGuard, *, with_optimizer: bool
) -> None:
    if with_optimizer:
        graph.add(
            "checkpoint_load",
            lambda model_transform, optimizer_init: _exclusive(generators, hook, model_transform, optimizer_init),
            deps=["model_transform", "optimizer_init"],
            collective=True,
        )
    else:
        graph.add(
            "checkpoint_load",
            lambda model_transform: _exclusive(generators, hook, model_transform, None),
            deps=["model_transform"],
            collective=True,
        )


def _fetches_in_workers(loader: Iterable[Any]) -> bool:
    return isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0


def _exclusive(generators: GeneratorGuard, fn: Callable[..., Any], *args: Any) -> Any:
    with generators.exclusive():
        return fn(*args)


def release_process_groups() -> int | None:
    """Destroy every process group and free it now, while the interpreter is fully alive; call it
    last in a job, after dropping the model, optimizer and anything else that holds a group.

    ``destroy_process_group()`` only unregisters a group: the C++ ``ProcessGroupGloo`` and its
    worker threads live on while any Python object still refers to it (``DistributedModelParallel``
    and its ``ShardingEnv``, a plan, a checkpointer), which at the end of a script means until the
    interpreter finalizes. A gloo worker thread frees each finished collective, and freeing a tensor
    that Python has already let go of (``broadcast_object_list``'s, TorchRec's all-to-all buffers)
    takes the GIL. When that happens while the interpreter finalizes, CPython ends the thread with
    ``pthread_exit``; its unwinding through the ``noexcept`` ``~AsyncWork`` calls ``std::terminate``
    and the rank dies of SIGABRT (``terminate called without an active exception``) after its work
    is done. Freed here, each group's destructor joins its worker threads (it releases the GIL while
    it waits), so that nothing of torch.distributed runs into interpreter exit.

    Returns:
        How many gloo worker threads are still running afterwards: ``0`` when every group is gone,
        more when something still refers to one (logged as a warning); ``None`` where threads
        cannot be listed (no ``/proc``).
    """
    import gc

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the groups referenced only from reference cycles (TorchRec modules) go now
    left = gloo_worker_threads()
    if left:
        log.warning(
            "warmstart: %d gloo worker thread(s) still running after destroy_process_group(): something "
            "still refers to a process group (a model, a ShardingEnv, a checkpointer); its threads "
            "will run into interpreter exit",
            left,
        )
    return left


def gloo_worker_threads() -> int | None:
    """How many of torch's gloo worker threads (``pt_gloo_runloop``) this process runs; ``None``
    where threads cannot be listed (no ``/proc``)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _default_planner(batch_size: int) -> Callable[[int, int, str], Any]:
    def build(world_size: int, local_world_size: int, compute_device: str) -> Any:
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

        topology = Topology(world_size=world_size, compute_device=compute_device, local_world_size=local_world_size)
        return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size)

    return build
