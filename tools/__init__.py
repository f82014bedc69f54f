"""Tools around the planner: profilers that feed the predictor and the emulated cluster.

    python -m tools.emulator      run a plan on this machine as if it were the cluster
    python -m tools.profile_compute  per-layer forward/backward time on the local device
    python -m tools.profile_network  link bandwidth/latency between the plan's hosts
"""
