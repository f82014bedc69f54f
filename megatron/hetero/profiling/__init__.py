"""The profilers that measure what ``hetero-plan --profiles DIR`` reads, run on the cluster's
own nodes (installed with the package, so that every node of a cluster has them):

    python -m megatron.hetero.profiling.compute -o DIR -- <model flags>   per-layer times of a device
    python -m megatron.hetero.profiling.network -o DIR                    links between hosts

Both run one process per device, under torchrun (or the emulator, tools/emulator). On a
Slurm cluster `hetero-plan profile --slurm` runs them on one node of every device class
(hetero/slurm/profile.py). The files they write are described in hetero/spec/profiles.py.
"""
