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
