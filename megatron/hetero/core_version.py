"""Which megatron-core releases the runtime runs on, and the check made at start-up.

Megatron-Hetero is tested with each release in ``TESTED_MEGATRON_CORE`` (``make test`` runs
the suite on the first and a named subset on the others). Every patch (patches/) states
the releases it applies to. Another release stops the job at start-up with the tested list,
unless the user asks for it (``--hetero-allow-untested-megatron-core`` or
HETERO_ALLOW_UNTESTED_MEGATRON_CORE=1): it then runs, with a warning, with the patches of
the nearest tested release below it (the oldest one for an older release).
"""

from __future__ import annotations

import re
import warnings

from hetero import env
from hetero.errors import HeteroError

# The releases `make test` runs on; the first is the one setup.py's plain install resolves to
# on Python 3.11 (0.19.2's wheel asks for Python >= 3.12).
TESTED_MEGATRON_CORE: tuple[str, ...] = ("0.16.1", "0.19.2")

ALLOW_UNTESTED_FLAG = "--hetero-allow-untested-megatron-core"


def _key(version: str) -> tuple[int, ...]:
    """'0.19.2' -> (0, 19, 2); a pre-release or local suffix is dropped ('0.20.0rc1' -> (0, 20, 0))."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split("+")[0].split(".")[:3])


def installed_megatron_core() -> str:
    """The installed megatron-core's release, without the '+<git hash>' that megatron-core
    0.17+ appends to its __version__ when its files lie inside a git checkout."""
    from megatron.core import package_info

    return getattr(package_info, "__shortversion__", package_info.__version__.split("+")[0])


def patches_release(version: str) -> str:
    """The tested release whose patches a run on ``version`` applies: itself when tested,
    else the nearest tested release below it (the oldest for an older one)."""
    if version in TESTED_MEGATRON_CORE:
        return version
    below = [tested for tested in TESTED_MEGATRON_CORE if _key(tested) <= _key(version)]
    return max(below, key=_key) if below else min(TESTED_MEGATRON_CORE, key=_key)


def untested_message(version: str) -> str:
    tested = " and ".join(TESTED_MEGATRON_CORE)
    return (f"megatron-core {version} is installed, but Megatron-Hetero's patches to megatron-core "
            f"are tested with megatron-core {tested} only; install one of them "
            f"(pip install megatron-core=={TESTED_MEGATRON_CORE[0]}), or give {ALLOW_UNTESTED_FLAG} "
            f"(or set {env.ALLOW_UNTESTED_MEGATRON_CORE}=1) to run on {version} at your own risk "
            f"with the patches of {patches_release(version)}")


def check_megatron_core_version(allow_untested: bool = False, version: str | None = None) -> str:
    """The installed release (or ``version``) when tested; otherwise a HeteroError naming the
    tested releases, or, when the user allows it (argument or environment), a warning."""
    version = version or installed_megatron_core()
    if version in TESTED_MEGATRON_CORE:
        return version
    if not (allow_untested or env.allow_untested_megatron_core()):
        raise HeteroError(untested_message(version))
    warnings.warn(untested_message(version).replace(" at your own risk", ""), stacklevel=2)
    return version
