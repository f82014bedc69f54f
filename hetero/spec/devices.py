"""Device identity: how a plan names a device and how a running process is matched to it."""

from __future__ import annotations

import re

CPU = "cpu"


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t]


def device_type_matches(expected: str, found: str) -> bool:
    """True when the device a process found is the device type a plan expects.

    Plans use short catalog names ("A100-40GB", "H100-80GB", "MI250X"); drivers report
    long marketing names ("NVIDIA A100-SXM4-40GB", "AMD Instinct MI250X"). A match means
    every token of the plan's name appears in the driver's name.
    """
    expected_tokens, found_tokens = _tokens(expected), set(_tokens(found))
    return bool(expected_tokens) and all(t in found_tokens for t in expected_tokens)
