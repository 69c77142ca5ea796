"""Compile every adversarial case (``_adversarial_cases.py``) under one condition and print one JSON
line: per case, whether the compiled result (and gradients) equal eager PyTorch's under the same
condition, whether its stored frames were installed (read, and nothing traced), and what was traced.

    ADVERSARIAL_CONDITION=x|y python _adversarial_job.py [CASE ...]

The condition comes from the environment so that every run has the same ``sys.argv``, which cases read.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _adversarial_cases as cases
import torch
from torch._dynamo.utils import counters


class _Said(logging.Handler):
    """What warmstart logs (info lines included) while a case runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


_said = _Said()
logging.getLogger("warmstart").addHandler(_said)
logging.getLogger("warmstart").setLevel(logging.INFO)


def _frames_reads() -> int:
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is None:
        return 0
    return sum(tier.get("dynamo_frames", {}).get("hits", 0) for tier in store.stats.to_dict().values())


def _leaves(args: tuple) -> tuple:
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)


def _run(target, args: tuple, backward: bool):
    args = _leaves(args)
    out = target(*args)
    grads = []
    if backward:
        params = list(target.parameters()) if isinstance(target, torch.nn.Module) else []
        for p in params:
            p.grad = None
        out.pow(2).sum().backward()
        grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + [p.grad for p in params]
    return out.detach(), grads


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def run_case(name: str, cond: str) -> dict:
    family, build = cases.CASES[name]
    reads, traced = _frames_reads(), counters["stats"].get("unique_graphs", 0)
    _said.lines.clear()
    case = build(cond)
    config_restore = None
    try:
        compiled = torch.compile(case.target)
        if name == "inductor_config_after_compile" and cond == "y":
            config_restore = torch._inductor.config.max_fusion_size
            torch._inductor.config.max_fusion_size = 7
        out, grads = _run(compiled, case.args, case.backward)
        original = case.target
        expected, expected_grads = _run(original, case.args, case.backward)
        same = (
            _same(out, expected)
            and len(grads) == len(expected_grads)
            and all(_same(g, e) for g, e in zip(grads, expected_grads, strict=True))
        )
        error = None
    except Exception:
        same, error = False, traceback.format_exc()[-1500:]
    finally:
        if config_restore is not None:
            torch._inductor.config.max_fusion_size = config_restore
        if case.teardown is not None:
            case.teardown()
    read = _frames_reads() - reads
    traced_now = counters["stats"].get("unique_graphs", 0) - traced
    return {
        "family": family,
        "same": same,
        "installed": read >= 1 and traced_now == 0,
        "frames_reads": read,
        "traced": traced_now,
        "must_trace": case.must_trace,
        "error": error,
        "said": [line for line in _said.lines if "compiled frames" in line],
    }


def main() -> None:
    import os

    cond, names = os.environ["ADVERSARIAL_CONDITION"], sys.argv[1:] or list(cases.CASES)
    del sys.argv[1:]  # the cases that read sys.argv see the same argv in every run
    results = {name: run_case(name, cond) for name in names}
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is not None:
        store.flush(timeout=60)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
