"""Megatron-LM's own GPT and MoE recipes (functional tests and example launch scripts at
core_v0.16.1) as flag facts, one scale-down rule, the heterogeneous plan each one also runs
under (plans.py), and the report of how each one runs here, without a plan and under it."""
