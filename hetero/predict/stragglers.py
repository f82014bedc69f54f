"""The slowest of several ranks that must meet: a synchronous step waits for it.

A rank's compute time varies from micro-batch to micro-batch (clock and power states on a
GPU, a CPU quota's periods on the emulator). Data-parallel replicas meet at the gradient
reduction, so an iteration lasts as long as the slowest replica's pipeline, and the
expected maximum of n noisy times exceeds their mean: by about 1.03 standard deviations
for four ranks alike. Each replica's end is taken as a normal variable (its simulated end,
and sqrt(micro-batches) times one micro-batch's measured standard deviation, the micro-
batches' noise independent), and the maximum is C. E. Clark's moment-matched maximum of
normals ("The greatest of a finite set of random variables", Operations Research 9(2),
1961), folded one group of alike replicas at a time (a group's own maximum integrated).
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Iterable

import numpy

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _max_of_two(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """(mean, variance) of max(X, Y) for independent normals X, Y given as (mean, variance)."""
    (mean_a, var_a), (mean_b, var_b) = a, b
    spread = math.sqrt(var_a + var_b)
    if spread <= 1e-12 * max(1.0, abs(mean_a), abs(mean_b)):
        return (mean_a, var_a) if mean_a >= mean_b else (mean_b, var_b)
    alpha = (mean_a - mean_b) / spread
    above = 0.5 * (1.0 + math.erf(alpha / _SQRT2))  # P(X > Y)
    density = _INV_SQRT_2PI * math.exp(-0.5 * alpha * alpha)
    mean = mean_a * above + mean_b * (1.0 - above) + spread * density
    second = ((mean_a * mean_a + var_a) * above + (mean_b * mean_b + var_b) * (1.0 - above)
              + (mean_a + mean_b) * spread * density)
    return mean, max(0.0, second - mean * mean)


@functools.lru_cache(maxsize=None)
def _standard_maximum(count: int) -> tuple[float, float]:
    """(mean, variance) of the maximum of `count` independent standard normals, integrated
    from its density count * phi(x) * Phi(x)^(count-1) (1.029 and 0.49 for four)."""
    x = numpy.linspace(-9.0, 9.0, 7201)
    pdf = _INV_SQRT_2PI * numpy.exp(-0.5 * x * x)
    cdf = numpy.concatenate(([0.0], numpy.cumsum((pdf[1:] + pdf[:-1]) / 2 * numpy.diff(x))))
    density = count * pdf * cdf ** (count - 1)
    mean = float(numpy.trapezoid(x * density, x))
    return mean, float(numpy.trapezoid(x * x * density, x)) - mean * mean


def expected_slowest(ends: Iterable[tuple[float, float, int]]) -> float:
    """Expected latest end over ranks given as (mean end, standard deviation, how many
    ranks alike). Without any spread this is the plain maximum of the means."""
    result: tuple[float, float] | None = None
    for mean, sigma, count in ends:
        if count < 1:
            continue
        if sigma > 0:
            standard_mean, standard_variance = _standard_maximum(count)
            group = (mean + sigma * standard_mean, sigma * sigma * standard_variance)
        else:
            group = (mean, 0.0)
        result = group if result is None else _max_of_two(result, group)
    if result is None:
        raise ValueError("expected_slowest: no ranks")
    return result[0]


def slowest_of(replicas: Iterable[tuple[float, float]]) -> float:
    """expected_slowest of replicas given one by one as (mean end, standard deviation):
    alike ones counted together, and the plain maximum where none varies (the catalog's
    devices, the planner's hot path)."""
    ends = list(replicas)
    if all(sigma == 0 for _, sigma in ends):
        return max(end for end, _ in ends)
    return expected_slowest((end, sigma, n) for (end, sigma), n in collections.Counter(ends).items())


def replica_spread(micro_batch_sigma: float, num_micro_batches: int) -> float:
    """Standard deviation of a replica's compute over `num_micro_batches` micro-batches, one
    varying by `micro_batch_sigma` seconds, independently of the others."""
    return micro_batch_sigma * math.sqrt(num_micro_batches)
