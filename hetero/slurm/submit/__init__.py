"""A plan as a Slurm job: `hetero-launch --slurm` writes (and submits) the batch script, and
the driver inside the allocation keeps the job alive (docs/slurm.md).

Writing and submitting (hetero-launch --slurm):
    command.py     the command: checks, writes the run directory, submits
    options.py     its flags, their checks, LaunchOptions
    components.py  the plan's node classes as job components, checked against the partition
    features.py    which Slurm nodes are which device; feature expressions that select them
    env_rules.py   --env [SELECTOR:]NAME=VALUE, per node
    script.py      the batch script
    run_dir.py     plan.json, launch.json, job.sbatch

Inside the allocation, the batch script's body runs the driver: hetero/slurm/driver/.

Both run Slurm's commands through hetero/slurm/client.py.
"""

from hetero.slurm.submit.options import add_arguments, slurm_options_given
from hetero.slurm.submit.command import main

__all__ = ["add_arguments", "main", "slurm_options_given"]
