"""Errors that mean "the user's input is wrong", each naming the problem and the fix."""


class HeteroError(ValueError):
    """A mistake in what the user gave us (plan, cluster, flags, launch), not a bug."""


class PlanError(HeteroError):
    """A plan file that is malformed or does not fit the job it is used for."""
