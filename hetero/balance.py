"""Who takes how many: whole units (decoder layers, micro-batches) shared out in proportion.

One rule everywhere, the largest remainder: each part takes its share rounded down, and the
units left over go one each to the parts whose shares lost the most in rounding (ties to
the lower index). Used by the plan's batch-size ramp (Plan.split_micro_batches) and by the
runtime's self-adapting split (megatron/hetero/adapt.py), for micro-batches and layers.
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Real
from typing import Sequence


def largest_remainder(shares: Sequence[Real], total: int, minimum: int = 0) -> list[int]:
    """Integers of at least `minimum` summing to total, as close to `shares` (which sum to
    total) as rounding allows: every share rounded down (to no less than the minimum); when
    the minimum pushed the sum over total, one unit at a time back from the part most over
    its share; then the units left to the largest remainders, ties to the lower index."""
    counts = [max(minimum, int(share)) for share in shares]
    while sum(counts) > total:  # the minimum pushed the sum over: take from the most over
        above = [i for i in range(len(counts)) if counts[i] > minimum]
        counts[max(above, key=lambda i: (counts[i] - shares[i], counts[i]))] -= 1
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_in_proportion(total: int, weights: Sequence[int]) -> list[int]:
    """total units shared out in proportion to whole-number weights by the largest-remainder
    rule, in exact arithmetic (shares are fractions: no rounding decides a tie). A part may
    get none."""
    whole = sum(weights)
    return largest_remainder([Fraction(total * weight, whole) for weight in weights], total)
