"""What a plan costs per token: dollars (rented devices) and joules (board power).

A job pays for every device it uses for as long as it runs, whether the device computes or
waits, so the cost of a token is the plan's rent (or power) per second over its tokens per
second. Devices the plan leaves out cost nothing: they are not rented (or are given back).
Power is each device's board power (TDP) for the whole run: an upper bound of the energy
drawn, the same bound for every plan, so plans compare fairly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

from hetero.spec.catalog import DeviceType


@dataclass(frozen=True)
class Economics:
    """A plan's throughput with its price and energy; None where a used device has no
    price (or no board power) in the catalog or the cluster spec."""

    tokens_per_s: float
    dollars_per_hour: float | None
    watts: float | None

    @property
    def dollars_per_million_tokens(self) -> float | None:
        if self.dollars_per_hour is None or self.tokens_per_s <= 0:
            return None
        return self.dollars_per_hour / 3600 / self.tokens_per_s * 1e6

    @property
    def joules_per_token(self) -> float | None:
        if self.watts is None or self.tokens_per_s <= 0:
            return None
        return self.watts / self.tokens_per_s

    def describe(self) -> str:
        """'420,402 tokens/s | $2.61 per 1M tokens | 0.37 J/token' (what is known)."""
        parts = [f"{self.tokens_per_s:,.0f} tokens/s"]
        if self.dollars_per_million_tokens is not None:
            parts.append(f"${self.dollars_per_million_tokens:.3g} per 1M tokens (${self.dollars_per_hour:,.2f}/h)")
        if self.joules_per_token is not None:
            parts.append(f"{self.joules_per_token:.3g} J/token ({self.watts / 1000:,.1f} kW)")
        return " | ".join(parts)


def economics(device_types: Iterable[str], tokens_per_s: float, devices: Mapping[str, DeviceType]) -> Economics:
    """The economics of a plan running on these devices (one entry per device used)."""
    counts = Counter(device_types)
    prices = [devices[name].price_per_hour for name in counts]
    powers = [devices[name].board_power_w for name in counts]
    dollars = None if None in prices else sum(p * counts[n] for n, p in zip(counts, prices))
    watts = None if None in powers else sum(w * counts[n] for n, w in zip(counts, powers))
    return Economics(tokens_per_s, dollars, watts)


def missing(device_types: Iterable[str], devices: Mapping[str, DeviceType], what: str) -> list[str]:
    """Device types without a price (what="price_per_hour") or power ("board_power_w")."""
    return sorted({name for name in device_types if getattr(devices[name], what) is None})


__all__ = ["Economics", "economics", "missing"]
