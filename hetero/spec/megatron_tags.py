"""Which Megatron-LM tag's flags go with the installed megatron-core.

Megatron-LM's flags are recorded per tag (megatron_lm_flags*.json beside this file, written by
tools/extract_megatron_flags.py). A process uses the tag of the installed megatron-core's
release, read from its package metadata (megatron-core is never imported here), or the one
HETERO_MEGATRON_LM_TAG names (tools/flags_doc.py renders each tag's table that way). An
untested release takes the tag of the nearest tested release below it, as the runtime's
patches do (megatron/hetero/core_version.py).
"""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata
from pathlib import Path

_HERE = Path(__file__).parent
# Each tested megatron-core release -> the Megatron-LM tag of its flags (oldest first: the
# reference tag, whose every flag has a ruling of its own).
TAGS: dict[str, str] = {"0.16.1": "core_v0.16.1", "0.19.2": "core_v0.19.0"}
FACTS_FILES: dict[str, Path] = {
    "core_v0.16.1": _HERE / "megatron_lm_flags.json",
    "core_v0.19.0": _HERE / "megatron_lm_flags.core_v0.19.0.json",
}
TAG_VARIABLE = "HETERO_MEGATRON_LM_TAG"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split("+")[0].split(".")[:3])


def installed_release() -> str | None:
    """The installed megatron-core's release from its package metadata (None without one)."""
    try:
        return metadata.version("megatron-core").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def tag_of_release(release: str | None) -> str:
    """The tag for a megatron-core release: its own, else the nearest tested release's below it
    (the oldest for an older one, or without megatron-core)."""
    if release is None:
        return next(iter(TAGS.values()))
    below = [tested for tested in TAGS if _key(tested) <= _key(release)]
    return TAGS[max(below, key=_key)] if below else next(iter(TAGS.values()))


@functools.cache
def megatron_tag() -> str:
    """The Megatron-LM tag whose flags this process uses."""
    chosen = os.environ.get(TAG_VARIABLE, "").strip()
    if chosen:
        if chosen not in FACTS_FILES:
            raise ValueError(f"{TAG_VARIABLE}={chosen}: no flag table for it; give one of {', '.join(FACTS_FILES)}")
        return chosen
    return tag_of_release(installed_release())


def facts_file(tag: str | None = None) -> Path:
    return FACTS_FILES[tag or megatron_tag()]
