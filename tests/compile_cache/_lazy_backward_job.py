"""A training step whose backward AOTAutograd lowers lazily, slowly: the lowering runs a post-grad
pass that sleeps far past the deferral after the forward's compile (shortened here to 0.1 s) and a
lease renewal. Prints ``RESULT <json>``: the AOTAutograd leases this process held after the forward
and during the backward's lowering, the store's counters after the step and torch's AOTAutograd
counters. Run with ``WARMSTART=1`` and a fresh ``WARMSTART_CACHE_DIR``."""

from __future__ import annotations

import json
import time

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from warmstart.compile_cache import get_store, single_flight

single_flight.DEFERRED_MIN_S = 0.1
SLOW_S = 2.5  # > DEFERRED_MIN_S + two renewals (every LEASE_TTL_S / 3 = 1 s)
seen: dict = {}


def _aot_leases() -> int:
    return sum(1 for kind, _ in list(get_store().single_flight._held) if kind == "aot_autograd")


class _SlowPass(CustomGraphPass):
    def uuid(self) -> str:
        return "lazy-backward-job-slow-pass"

    def __call__(self, graph) -> None:
        time.sleep(SLOW_S)
        seen["aot_leases_in_backward"] = _aot_leases()


model = torch.nn.Linear(8, 1)
loss = torch.compile(model)(torch.randn(4, 8)).sum()
seen["aot_leases_after_forward"] = _aot_leases()
torch._inductor.config.post_grad_custom_post_pass = _SlowPass()  # the backward is lowered after this
loss.backward()

from torch._dynamo.utils import counters  # noqa: E402

seen["held_after"] = get_store().single_flight.held
seen["counters"] = get_store().stats.counters_dict()
seen["aot_autograd"] = dict(counters["aot_autograd"])
print("RESULT " + json.dumps(seen), flush=True)
