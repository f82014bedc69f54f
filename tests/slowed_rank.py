"""Runs pretrain_gpt.py with every forward step of the ranks in SLOW_RANKS (LOCAL_RANK values)
made SLOW_FORWARD_S seconds longer, for tests that need ranks of unequal speed. A sleep, not
shared or pinned CPUs: how much slower a rank is must not depend on what else the machine runs
(a rank on a shared core is 2x slower on an idle machine and about equal on a busy one).

Under torchrun (LOCAL_RANK set) it is one rank. Started as plain ``python`` with SLOW_NPROC=N,
it is the whole job: N ranks forked from this process once it has imported the runtime
(tests/forkrun.py), which spares each rank its own ~4 s of imports.
"""

import os
import runpy
import sys
import time
from pathlib import Path

from megatron.core.pipeline_parallel import schedules

SLOW_RANKS = os.environ["SLOW_RANKS"].split()
DELAY_S = float(os.environ["SLOW_FORWARD_S"])
original_forward = schedules.forward_step


def slowed_forward_step(*args, **kwargs):
    # LOCAL_RANK is read at the call: forked ranks get theirs after this module ran.
    if os.environ.get("LOCAL_RANK") in SLOW_RANKS:
        time.sleep(DELAY_S)
    return original_forward(*args, **kwargs)


# The schedules look forward_step up in their module at every call; the runtime's own
# timing wrapper (applied later, at start-up) wraps this one, so the delay is measured.
schedules.forward_step = slowed_forward_step

if "LOCAL_RANK" not in os.environ and "SLOW_NPROC" in os.environ:
    import forkrun

    forkrun.import_runtime()
    sys.argv[0] = "pretrain_gpt.py"
    sys.exit(forkrun.run_job(int(os.environ["SLOW_NPROC"]), sys.argv[1:]))

script = str(Path(__file__).resolve().parent.parent / "pretrain_gpt.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
