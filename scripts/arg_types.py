"""argparse types of the benchmark scripts' sizes: a bad value is refused as the options are parsed, naming the
option (argparse: "argument --repeats: 0 is not an int >= 1"), not after the model is built."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = int(text)  # a ValueError is argparse's "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not an int >= 1")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is not a finite number > 0")
    return value
