"""Everything that talks to Slurm (docs/slurm.md): reading the cluster, profiling it on its
own nodes, submitting a plan as a batch job and keeping that job alive.

    text.py      Slurm's text (scontrol's key=value lines, host lists, GRES, topology) parsed;
                 Runner, how every Slurm command runs
    client.py    the Slurm commands a launch and its driver run (scontrol, sbatch, srun,
                 scancel, salloc)
    steps.py     several srun steps run at once, their output streamed, a failed one
                 stopping the others (the profiler's)
    probe.py     one node's devices and NICs, probed by a short srun step
    discover.py  `hetero-plan discover --slurm`: the cluster spec from Slurm and the probes
    profile.py   `hetero-plan profile --slurm`: the profilers run on the cluster's nodes
    submit/      `hetero-launch --slurm`: the plan checked against Slurm, written (and
                 submitted) as a heterogeneous batch job
    driver/      the batch script's body: binds the plan to the allocation, one srun step per
                 node, re-plans after a lost node, takes returned nodes back

hetero/spec/ describes the inputs (cluster, model, profiles); this package makes and runs
them on Slurm. The driver builds on hetero/launch/ (node commands, the elastic re-plan).
"""
