"""Entry point of the reference job: ``torchrun --nproc-per-node 2 -m warmstart.bench.reference_job``.

The attempt's clock starts first, before torch and TorchRec are imported (importing them is part of
what every start and restart costs: the ``imports`` span), then the trainer is built, trained and
closed whatever happens, as in torchtitan's ``train.py``. With ``--mode warmstart`` and
``WARMSTART=1`` in the environment the same script runs with every warmstart part on; see
``docs/reference_job.md``.

Example:
    WARMSTART=1 WARMSTART_RUN_DIR=runs/demo torchrun --nproc-per-node 2 --max-restarts 1 \\
        -m warmstart.bench.reference_job --mode warmstart --steps 240 --fail-at-step 150
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys


def main(argv: list[str] | None = None) -> None:
    """Run one attempt of the reference job on this rank."""
    # `kill -USR1 <rank pid>` writes every thread's Python stack to stderr (the job's log) and the job
    # goes on; the benchmark's no-progress watchdog does that before it stops a stalled job. Forked
    # processes (the loader workers) inherit it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from warmstart.bench.config import JobConfig
    from warmstart.metrics import get_recorder

    cfg = JobConfig.from_args(argv)
    rec = get_recorder()
    rec.attempt_start(devices=1)

    # 2 ranks share 2 cores: one thread per rank and one Inductor compile thread, set before torch loads
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    _quiet_known_warnings()
    with rec.span("imports"):  # torch, TorchRec and torch's compiler: part of every start and restart
        from warmstart.bench.trainer import Trainer

        _import_compiler()

    trainer = None
    try:
        trainer = Trainer(cfg, rec)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    rec.attempt_end()
    rec.close()


def _import_compiler() -> None:
    # torch.compile loads Dynamo, AOTAutograd and Inductor on its first call (2.5-4 s here, in every
    # configuration, beyond any cache's reach): load them with the job's other modules, so that the
    # compile bucket holds what caching can change.
    import importlib

    from warmstart.torch_internals import COMPILE_ENTRY_MODULES

    for name in COMPILE_ENTRY_MODULES:
        importlib.import_module(name)


def _quiet_known_warnings() -> None:
    # Deprecation notices of the pinned torch / TorchRec that fire on every rank and every attempt and
    # would bury the job's own output; none of them concerns what this job does.
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    warnings.filterwarnings("ignore", message=r".*is_fx_tracing.*")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torchrec.distributed.planner.storage_reservations").setLevel(logging.ERROR)


if __name__ == "__main__":
    main(sys.argv[1:])
