"""Megatron-LM's performance features under a plan, as megatron-core settings.

Nothing here re-implements a feature: each flag becomes the TransformerConfig or
DistributedDataParallelConfig field that megatron-core already has, decided the way
Megatron-LM's ``validate_args`` / ``core_transformer_config_from_args`` decide it, plus
what a heterogeneous plan adds:

- recomputation per stage: ``stages[s].recompute`` of a version 2 plan overrides the
  ``--recompute-*`` flags for stage s (a small-memory device recomputes, a large one not);
- interleaved 1F1B with uneven virtual stages: ``stages[s].virtual_stages`` (or an even
  split from ``--num-virtual-stages-per-pipeline-rank`` /
  ``--num-layers-per-virtual-pipeline-stage``) becomes megatron-core's
  ``pipeline_model_parallel_layout`` with one entry per virtual stage;
- Megatron-LM's default fused kernels on GPUs, each on exactly when Megatron-LM turns it
  on, except where Megatron-LM would stop with an error because the kernel's package is
  missing: there it is off and the start-up line says so.

Modules: ``checks`` (the flags against the plan, before any process group exists: the
refusals, the even interleaved split) and ``settings`` (the megatron-core fields a stage is
built with, the fused kernels this process runs, the start-up lines).
"""

from megatron.hetero.performance.settings import (
    Fusions,
    ddp_fields,
    describe_recompute,
    gpu_fusions,
    local_attention,
    megatron_fusions,
    recompute_fields,
    startup_lines,
    transformer_engine_on_gpu,
    transformer_fields,
)
from megatron.hetero.performance.checks import (
    check_performance_flags,
    configure_performance,
    performance_on_plan,
)

__all__ = [
    "Fusions",
    "check_performance_flags",
    "configure_performance",
    "ddp_fields",
    "describe_recompute",
    "gpu_fusions",
    "local_attention",
    "megatron_fusions",
    "performance_on_plan",
    "recompute_fields",
    "startup_lines",
    "transformer_engine_on_gpu",
    "transformer_fields",
]
