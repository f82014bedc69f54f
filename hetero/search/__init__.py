"""The planner's search: candidate layouts priced by a fast estimate (a reduction of the
predictor), their placement on devices, and the Megatron baseline it is measured against."""
