"""An emulated heterogeneous cluster on one machine: namespaces, shaped links, CPU quotas."""

from tools.emulator.cluster import EmulatedCluster, JobResult, RankLayout, stop_on_termination_signals

__all__ = ["EmulatedCluster", "JobResult", "RankLayout", "stop_on_termination_signals"]
