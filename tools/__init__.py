"""Tools around the planner: the emulated cluster and document generators.

    python -m tools.emulator      run a plan on this machine as if it were the cluster

The profilers that feed the predictor are installed with the runtime:
megatron/hetero/profiling/ (python -m megatron.hetero.profiling.compute / .network).
"""
