"""One job for the Dynamo-frames tests: import ``frames_model`` from the directory given, change
what ``--variant`` says, compile ``--model`` with ``torch.compile``, run forward and backward, and
print one JSON line: whether outputs and gradients equal eager PyTorch's, how many graphs Dynamo
traced, and the store's ``dynamo_frames`` counts.

    python _frames_job.py MODEL_DIR --model net|broken|stack|callee --variant base|global|flag|builtin|shape|dtype|
        attribute|submodule|torch-config|threads|taken|backends

``threads`` (with ``stack``): another thread compiles and runs a second instance of the model while this one
holds Dynamo's compile lock, as a thread tracing a frame would; the JSON says whether installing the
stored frames waited for it. ``taken`` (with ``broken``): ``Twin`` is compiled and run first, so its
resume function holds the name the producer gave Broken's; both must still compute what they should.
``backends``: after the usual compile and run, the model is compiled again with a backend of the
test's own, which must be the one that runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import threading

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--model", default="net")
    parser.add_argument("--variant", default="base")
    args = parser.parse_args()
    sys.path.insert(0, args.model_dir)
    import frames_model

    torch.manual_seed(0)
    model = {
        "net": frames_model.Net,
        "broken": frames_model.Broken,
        "stack": frames_model.Stack,
        "callee": frames_model.Callee,
    }[args.model]()
    x = torch.randn(12 if args.variant == "shape" else 8, 16)
    variant = args.variant
    if variant == "global":
        frames_model.SCALE = 3.0
    elif variant == "flag":
        frames_model.USE_GELU = False
    elif variant == "builtin":
        frames_model.ACT = torch.sigmoid
    elif variant == "dtype":
        model, x = model.double(), x.double()
    elif variant == "attribute":
        model.scale = 0.5
    elif variant == "submodule":
        model.act = nn.GELU()
    elif variant == "torch-config":
        torch._inductor.config.max_fusion_size = 7
    extra: dict = {}
    others = []  # (compiled, eager) of other modules this variant runs
    if variant == "threads":
        extra["install_waited"] = _install_waits_for_dynamo(frames_model, x, others)
    elif variant == "taken":
        twin = frames_model.Twin()
        twin_eager = copy.deepcopy(twin)
        others.append((torch.compile(twin), twin_eager))
        _same(*others[-1], x)  # traced here: its frames now call this process's resume function
    eager = copy.deepcopy(model)
    if args.model == "stack":
        for layer in model.layers:  # regional: each layer compiled on its own
            layer.compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    out = compiled(x)
    same = _same(compiled, eager, x, out) and all(_same(c, e, x) for c, e in others)
    if variant == "backends":
        calls = []

        def counting(gm, example_inputs):
            calls.append(1)
            return gm.forward

        again = copy.deepcopy(eager)
        same = same and _same(torch.compile(model, backend=counting), again, x) and _same(compiled, eager, x)
        extra["other_backend_calls"] = len(calls)
    from torch._dynamo.utils import counters

    result = {
        "same": bool(same),
        "loss": float(out.detach().double().pow(2).sum()),
        "traced": counters["stats"].get("unique_graphs", 0),
        "frames_hits": 0,
        "frames_misses": 0,
        "frames_writes": 0,
        "frames_rejected": 0,
        **extra,
    }
    from warmstart.compile_cache import get_store

    store = get_store()
    if store is not None:
        store.flush(timeout=30)
        for tier in store.stats.to_dict().values():
            kind = tier.get("dynamo_frames", {})
            result["frames_hits"] += kind.get("hits", 0)
            result["frames_misses"] += kind.get("misses", 0)
            result["frames_writes"] += kind.get("writes", 0)
            result["frames_rejected"] += kind.get("rejected", 0)
    print("RESULT " + json.dumps(result), flush=True)


def _same(compiled, eager: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the compiled module's output and gradients equal eager PyTorch's on ``x`` (gradients
    of this call alone: a module may be run more than once)."""
    model = compiled._orig_mod if hasattr(compiled, "_orig_mod") else compiled
    for parameter in [*model.parameters(), *eager.parameters()]:
        parameter.grad = None
    out = compiled(x) if out is None else out
    out.pow(2).mean().backward()
    expected = eager(x)
    expected.pow(2).mean().backward()
    return torch.allclose(out, expected, atol=1e-5, rtol=1e-5) and all(
        torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5)
        for a, b in zip(model.parameters(), eager.parameters(), strict=True)
    )


def _install_waits_for_dynamo(frames_model, x: torch.Tensor, others: list) -> bool:
    """Whether another thread's first call of its compiled layers (which installs the stored frames)
    waits while this thread holds Dynamo's compile lock."""
    from torch._dynamo import convert_frame

    other = frames_model.Stack()  # the same layers: the same keys
    others.append((other, copy.deepcopy(other)))
    done = threading.Event()

    def compile_other():
        for layer in other.layers:
            layer.compile()
        other(x)  # the first call installs the stored frames
        done.set()

    worker = threading.Thread(target=compile_other)
    with convert_frame.compile_lock:
        worker.start()
        waited = not done.wait(3.0)
    worker.join()
    return waited


if __name__ == "__main__":
    main()
