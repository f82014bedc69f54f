"""The driver of a Slurm job that hetero-launch --slurm wrote: the supervisor inside the
allocation, run by the batch script as `python -m hetero.slurm.driver` (driver.py
says what it does and why; docs/slurm.md).

    driver.py      the entry point and the attempt loop: run, lose a node, re-plan, resume
    job.py         the job in its allocation: binding at start, lost nodes, driver.json
    binding.py     the plan's hosts bound to the allocated nodes
    attempt.py     one attempt: every node's step, watched until the job ends or must stop
    steps.py       one node's srun step: its command line, environment, probe and stop
    readmission.py returned nodes taken back into the job

Its Slurm commands run through hetero.slurm.client.
"""
