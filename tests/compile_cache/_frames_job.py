"""One job for the Dynamo-frames tests: import ``frames_model`` from the directory given, change
what ``--variant`` says, compile ``--model`` with ``torch.compile``, run forward and backward, and
print one JSON line: whether outputs and gradients equal eager PyTorch's, how many graphs Dynamo
traced, and the store's ``dynamo_frames`` counts.

    python _frames_job.py MODEL_DIR --model net|broken --variant base|global|flag|builtin|shape|dtype|
        attribute|submodule|torch-config|regional
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

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
    model = {"net": frames_model.Net, "broken": frames_model.Broken, "stack": frames_model.Stack}[args.model]()
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
    eager = copy.deepcopy(model)
    if args.model == "stack":
        for layer in model.layers:  # regional: each layer compiled on its own
            layer.compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    out = compiled(x)
    out.pow(2).mean().backward()
    expected = eager(x)
    expected.pow(2).mean().backward()
    same = torch.allclose(out, expected, atol=1e-5, rtol=1e-5) and all(
        torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5)
        for a, b in zip(model.parameters(), eager.parameters()))
    from torch._dynamo.utils import counters

    result = {"same": bool(same), "loss": float(out.detach().double().pow(2).sum()), "traced": counters["stats"].get("unique_graphs", 0), "frames_hits": 0,
              "frames_misses": 0, "frames_writes": 0, "frames_rejected": 0}
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


if __name__ == "__main__":
    main()
