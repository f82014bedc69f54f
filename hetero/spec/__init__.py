"""What the planner plans for: the cluster (nodes, devices, NICs, fabrics), the device
and link catalog, the model, and measured profiles."""
