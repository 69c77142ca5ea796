"""One job for ``benchmarks/gpu_check.py``: compile one model on one device, run its first step(s)
(forward and, where the model has one, backward), print one ``RESULT`` JSON line.

    python benchmarks/gpu_job.py --model inductor [--device cuda|cpu]

The environment decides whether warmstart is on (``WARMSTART=1``, ``WARMSTART_CACHE_URL``,
``WARMSTART_KEY_FILE``), as it would for a user's job. The line holds: a summary of the outputs and
gradients (``values``, compared with a tolerance) and their SHA-256 (``digest``, compared exactly),
the seconds to compile and run the first step(s), torch's counters and warmstart's store stats.
"""

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

T_START = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402

T_IMPORTED = time.perf_counter()

# torch.compile loads Dynamo, AOTAutograd and Inductor on its first call: the same seconds in every
# configuration and beyond any cache's reach. Load them before the clock starts, as compile_job.py
# does, so that the timed part is what caching can change; reported as compiler_import_s.
import torch._dynamo  # noqa: E402
import torch._functorch._aot_autograd.autograd_cache  # noqa: E402
import torch._inductor.codecache  # noqa: E402
import torch._inductor.compile_fx  # noqa: E402

if torch.cuda.is_available():
    # Triton comes with CUDA builds of torch only: imported where a GPU can run its kernels, never
    # on CPU-only machines. The user kernel lives at module level, as user kernels usually do
    # (Dynamo and Inductor find it as a global).
    import triton
    import triton.language as tl

    @triton.jit
    def scale_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x * scale + y, mask=mask)
else:
    triton = None

T_COMPILER_IMPORTED = time.perf_counter()

SCALE_ADD_BLOCK = 1024


def scale_add(x: torch.Tensor, y: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """``x * scale + y`` by the user Triton kernel (contiguous CUDA tensors of one shape)."""
    out = torch.empty_like(x)
    n = x.numel()
    # Plain arithmetic for the grid (not triton.cdiv): Dynamo traces it as Python integers.
    scale_add_kernel[((n + SCALE_ADD_BLOCK - 1) // SCALE_ADD_BLOCK,)](x, y, out, n, scale, BLOCK=SCALE_ADD_BLOCK)
    return out


class Block(nn.Module):
    """An MLP followed by an attention block: Inductor's everyday GPU path (fused Triton kernels,
    matmuls, softmax, layer norms), forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.attn = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.attn(x + self.mlp(x)).mean(1))


class UserTriton(nn.Module):
    """A linear layer, then the user Triton kernel: forward only (the kernel has no backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        h = torch.relu(self.lin(x)).contiguous()
        return scale_add(h, x)


class MatmulNet(nn.Module):
    """Matmul-heavy: under max-autotune Inductor benchmarks Triton templates for every matmul shape."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)
        )

    def forward(self, x):
        return self.net(x)


class Encoder(nn.Module):
    """Many small layers: Dynamo's tracing, not Inductor's kernels, is a large part of the compile."""

    def __init__(self, layers: int = 12, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model=width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


class Matmul(nn.Module):
    """The cheapest model: one matmul, forward and backward. Its graphs hold no generated kernel, so
    on CPU nothing is built by g++; it checks the flow quickly (FX graph and AOTAutograd entries)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return x @ self.weight


@dataclass(frozen=True)
class Spec:
    """How one model is built, fed and compiled."""

    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    mode: str | None = None  # torch.compile's mode
    backward: bool = True
    steps: int = 1  # steps in the timed part
    eager_first: bool = False  # run the model once uncompiled first, in the timed part
    cuda_only: bool = False


MODELS: dict[str, Spec] = {
    "inductor": Spec(Block, (8, 32, 64)),
    # Run eagerly first: Triton then compiles the user kernel itself, through TRITON_CACHE_MANAGER;
    # the compiled function's copy of the kernel is compiled by Inductor.
    "user-triton": Spec(UserTriton, (64, 256), backward=False, eager_first=True, cuda_only=True),
    "max-autotune": Spec(MatmulNet, (256, 512), mode="max-autotune-no-cudagraphs", cuda_only=True),
    # CUDA graph trees record on a later call than the first: three steps, so that recording and a
    # replay are inside the timed part.
    "cudagraphs": Spec(Block, (8, 32, 64), mode="reduce-overhead", steps=3, cuda_only=True),
    "dynamo-frames": Spec(Encoder, (4, 16, 32)),
    "matmul": Spec(Matmul, (8, 16)),
}


def _summary(tensors: list[torch.Tensor]) -> tuple[list[float], str]:
    """Per tensor: sum of absolute values and sum of squares (in float64), and the SHA-256 of all the
    tensors' bytes. Sums of absolute values never cancel, so a relative tolerance on them is tight."""
    values: list[float] = []
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        values += [float(t.double().abs().sum()), float(t.double().pow(2).sum())]
        digest.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return values, digest.hexdigest()


def run_model(name: str, device: str) -> dict:
    """Build, compile and run ``name`` on ``device`` from fixed seeds; the outputs' summary."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build().to(device)
    # Made on the CPU and copied: the same numbers whatever the device.
    x = torch.randn(spec.input_shape).to(device)
    tensors: list[torch.Tensor] = []
    if spec.eager_first:
        with torch.no_grad():
            tensors.append(model(x).clone())
    compiled = torch.compile(model, mode=spec.mode)
    loss = torch.zeros(())
    out = x
    for _ in range(spec.steps):
        if spec.mode == "reduce-overhead":
            # Tells CUDA graph trees a new iteration starts, so the previous step's outputs may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        for p in model.parameters():
            p.grad = None
        out = compiled(x)
        loss = out.float().pow(2).mean()
        if spec.backward:
            loss.backward()
        out = out.detach().clone()  # CUDA graph outputs are overwritten by the next replay
    if device == "cuda":
        torch.cuda.synchronize()
    tensors.append(out)
    if spec.backward:
        tensors += [p.grad for p in model.parameters()]
    values, digest = _summary(tensors)
    return {"loss": float(loss.detach()), "values": [float(loss.detach())] + values, "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_job: --device cuda but torch.cuda.is_available() is False")
        # The CUDA context costs the same in every configuration: created before the clock starts.
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    elif MODELS[args.model].cuda_only:
        raise SystemExit(f"gpu_job: {args.model} runs on cuda only")
    t0 = time.perf_counter()
    outcome = run_model(args.model, args.device)
    compile_s = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    result = {
        "model": args.model,
        "device": args.device,
        "mode": MODELS[args.model].mode,
        **outcome,
        "compile_s": compile_s,
        "import_s": T_IMPORTED - T_START,
        "compiler_import_s": T_COMPILER_IMPORTED - T_IMPORTED,
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
        "dynamo": {k: counters["stats"].get(k, 0) for k in ("unique_graphs", "calls_captured")},
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    from _new_machine import store_figures

    result.update(store_figures())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
