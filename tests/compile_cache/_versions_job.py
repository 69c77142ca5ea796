"""One compile job for the torch-version tests: a small model compiled (forward and backward) twice,
as two frames, and one ``RESULT`` JSON line with its losses and what warmstart switched on.

Options, applied before torch is imported (warmstart's hooks run as torch's modules are imported):
``--checked V1,V2`` makes warmstart take those as the torch versions it was checked against (an
unchecked torch, here); ``--frames-checked V1,V2`` the versions compiled frames were checked against;
``--force-autotune`` makes warmstart take torch's autotune caches as usable
on this machine (a precondition that turned out wrong), so that torch itself raises in them.
"""

from __future__ import annotations

import json
import sys

if "--checked" in sys.argv:
    from warmstart import torch_support

    torch_support.TORCH_VERSIONS_CHECKED = tuple(sys.argv[sys.argv.index("--checked") + 1].split(","))
if "--frames-checked" in sys.argv:
    from warmstart import torch_support

    torch_support.FRAMES_VERSIONS_CHECKED = tuple(sys.argv[sys.argv.index("--frames-checked") + 1].split(","))
if "--force-autotune" in sys.argv:
    from warmstart.compile_cache import torch_hooks

    torch_hooks.autotune_caches_usable = lambda: (True, "taken as usable by the test")

import torch  # noqa: E402


def _loss(width: int) -> float:
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    x = torch.randn(16, 8)
    loss = torch.compile(model)(x).pow(2).mean()
    loss.backward()
    return round(loss.item(), 6)


def main() -> None:
    losses = [_loss(16), _loss(24)]
    import torch._inductor.config as inductor_config

    from warmstart import torch_internals
    from warmstart.compile_cache import get_store

    result = {
        "torch": torch.__version__,
        "losses": losses,
        "autotune_remote_cache": inductor_config.autotune_remote_cache,
        "bundled_autotune_remote_cache": inductor_config.bundled_autotune_remote_cache,
        "fx_graph_remote_cache": inductor_config.fx_graph_remote_cache,
        # Whether every hook compiled frames need went in (asking dynamo_frames.enabled() here would
        # say a warning the job itself might not have said).
        "frames": get_store() is not None and not torch_internals.unhooked(torch_internals.FRAMES_MODULES),
        "triton": "triton" in sys.modules,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
