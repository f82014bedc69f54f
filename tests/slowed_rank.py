"""Runs pretrain_gpt.py with every forward step of the ranks in SLOW_RANKS (LOCAL_RANK values)
made SLOW_FORWARD_S seconds longer, for tests that need ranks of unequal speed. A sleep, not
shared or pinned CPUs: how much slower a rank is must not depend on what else the machine runs
(a rank on a shared core is 2x slower on an idle machine and about equal on a busy one)."""

import os
import runpy
import sys
import time
from pathlib import Path

if os.environ["LOCAL_RANK"] in os.environ["SLOW_RANKS"].split():
    from megatron.core.pipeline_parallel import schedules

    delay, original_forward = float(os.environ["SLOW_FORWARD_S"]), schedules.forward_step

    def slowed_forward_step(*args, **kwargs):
        time.sleep(delay)
        return original_forward(*args, **kwargs)

    # The schedules look forward_step up in their module at every call; the runtime's own
    # timing wrapper (applied later, at start-up) wraps this one, so the delay is measured.
    schedules.forward_step = slowed_forward_step

script = str(Path(__file__).resolve().parent.parent / "pretrain_gpt.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
