"""Runs pretrain_gpt.py on the CPUs that PIN_CPUS gives this LOCAL_RANK, for tests that need
ranks of unequal speed without root: PIN_CPUS="0 0 1" puts ranks 0 and 1 on CPU 0 (each
half as fast) and rank 2 alone on CPU 1."""

import os
import runpy
import sys
from pathlib import Path

cpus = os.environ["PIN_CPUS"].split()
os.sched_setaffinity(0, {int(cpus[int(os.environ["LOCAL_RANK"])])})
script = str(Path(__file__).resolve().parent.parent / "pretrain_gpt.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
