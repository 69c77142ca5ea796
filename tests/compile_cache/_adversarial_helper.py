"""Another module for the adversarial cases: constants, a helper function and an object that the
compiled functions read from here rather than from their own module."""

from __future__ import annotations

SCALE = 2.0
OFFSET = 1.0
TABLE = {"gain": 2.0}


class Config:
    gain = 2.0


CONFIG = Config()


def shifted(x):
    return x * SCALE + OFFSET


GAINS = [2.0]

import dataclasses  # noqa: E402

import numpy  # noqa: E402

NP_GAIN = numpy.float64(2.0)
ORDERED = {"double": 2.0, "shift": 1.0}


@dataclasses.dataclass(frozen=True)
class Frozen:
    gain: float = 2.0


FROZEN = Frozen()

INT_TABLE_ORDER = {1: 2.0, 2: 3.0}
INT_TABLE_KEYS = {1: 2.0, 2: 3.0}

NESTED = [[[2.0, 1.0]], [[3.0]]]
LONG = [float(i % 5) for i in range(40)]
VALUED = {"gain": (2.0, 1.0)}
ANGLE = 0.5

from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402


class NoOpPass(CustomGraphPass):
    """A post-grad pass that changes nothing; its presence is a compiler setting all the same."""

    def __call__(self, graph):
        return None

    def uuid(self):
        return "adversarial-no-op-pass"


MANY_KEYS = {f"k{i}": 1.0 + (i % 3) / 4 for i in range(40)}
