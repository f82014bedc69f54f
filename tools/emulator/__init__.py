"""An emulated heterogeneous cluster on one machine: namespaces, shaped links, CPU quotas."""

from tools.emulator.cluster import EmulatedCluster, JobResult, RankLayout

__all__ = ["EmulatedCluster", "JobResult", "RankLayout"]
