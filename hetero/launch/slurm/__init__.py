"""A plan as a Slurm job: `hetero-launch --slurm` writes (and submits) the batch script, and
the driver inside the allocation keeps the job alive (docs/slurm.md).

Writing and submitting (hetero-launch --slurm):
    submit.py      the command: checks, writes the run directory, submits
    options.py     its flags, their checks, LaunchOptions
    components.py  the plan's node classes as job components, checked against the partition
    features.py    which Slurm nodes are which device; feature expressions that select them
    env_rules.py   --env [SELECTOR:]NAME=VALUE, per node
    script.py      the batch script
    run_dir.py     plan.json, launch.json, job.sbatch

Inside the allocation, the batch script's body runs the driver: hetero/launch/slurm_driver/.

Both run Slurm's commands through client.py.
"""

from hetero.launch.slurm.options import add_arguments, slurm_options_given
from hetero.launch.slurm.submit import main

__all__ = ["add_arguments", "main", "slurm_options_given"]
