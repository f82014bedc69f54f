"""The cost model: per-layer and per-transfer costs, memory, the 1F1B schedule, the wait
for the slowest replica, and the predictor that prices a whole plan."""
