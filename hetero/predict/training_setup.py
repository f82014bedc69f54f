"""How the job runs beyond its plan: precision, kernels, recomputation, overlaps and the
other switches of pretrain_gpt.py that change what an iteration costs (TrainingSetup), and
the byte sizes they imply. A plan's `training` section is one of these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from hetero.errors import HeteroError
from hetero.spec.recompute import check as check_recompute

BYTES_PER_VALUE = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
# fp8 training (transformer-engine's recipes, Megatron's --fp8-format): each linear layer casts
# its GEMM inputs to fp8 and runs the GEMM on the fp8 matrix units (twice the 16-bit dense
# peak on Hopper, Ada and CDNA3 data sheets); activations, weights, the attention core and
# communication stay bf16. Per GEMM input: read in bf16 (2 bytes), written in fp8 and as its
# fp8 transpose for the other pass's GEMM (1 + 1): transformer-engine's fused cast-transpose.
FP8_PEAK_OVER_16BIT = 2.0
FP8_CAST_BYTES_PER_VALUE = 4
# Megatron's --fp8-recipe. Delayed scaling casts with the scale of earlier steps' maxima; the
# block and MX recipes find each block's maximum inside the cast kernel; tensorwise (current)
# scaling first reads the whole input for its maximum, then casts it: 2 more bytes a value.
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_AMAX_PASS_BYTES_PER_VALUE = {"tensorwise": 2}
# Flash attention's backward recomputes the scores and runs four more matrix products (the
# probabilities' gradient, dV, dQ, dK): five against the forward's two (Dao et al.,
MOE_DISPATCHERS = ("alltoall", "flex")


@dataclass(frozen=True)
class TrainingSetup:
    """How the job runs, beyond the plan: what pretrain_gpt.py's flags and kernels will be."""

    precision: str = "bf16"
    distributed_optimizer: bool = True
    fused_kernels: bool = True
    """GPU kernels as transformer-engine provides them: flash attention (no score matrix
    kept) and fused SwiGLU. Off for megatron-core's local layers (the CPU runtime)."""
    dropout: bool = True
    """Hidden/attention dropout > 0 (Megatron's default 0.1): masks are kept for backward."""
    recompute: str = "none"
    """Activation recomputation (--recompute-granularity, hetero/spec/recompute.py): none, full
    (every layer's forward again during backward), selective (megatron-core's default module,
    the attention core) or selective:MODULE,... (--recompute-modules)."""
    sequence_parallel: bool = False
    """--sequence-parallel: norms and dropouts split over the tensor-parallel ranks."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B when > 1)."""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: the gradient reduction runs during the last backward."""
    overlap_param_gather: bool = False
    """--overlap-param-gather (distributed optimizer): the all-gather of updated weights
    runs during the next forward."""
    grad_reduce_dtype: str | None = None
    """Gradient buffers and their reduction: None is Megatron's default (fp32 for bf16
    runs, the model dtype otherwise); bf16 is --grad-reduce-in-bf16."""
    scatter_stage_transfers: bool = False
    """Each tensor-parallel rank sends 1/TP of the activation to the next stage and the
    receiver all-gathers (sequence parallelism implies it)."""
    fused_softmax: bool | None = None
    """Without flash attention: whether the scores go through a fused scale-mask-softmax
    kernel (apex's; Megatron-LM's own compiled one in its 2021 releases) or megatron-core's
    torch fallback, several passes over the score matrix (hetero/predict/fixed_costs.py).
    None: as fused_kernels."""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap (transformer-engine's userbuffers): each layer's tensor-parallel
    all-gathers and reduce-scatters run in chunks under the GEMMs next to them
    (tensor_parallel_overlap.py)."""
    moe_dispatcher: str = "alltoall"
    """--moe-token-dispatcher-type: alltoall (megatron-core's all-to-all: each of a token's
    top-k copies travels to its expert's rank) or flex (DeepEP / HybridEP: a token crosses to
    each other node holding one of its experts once and is fanned out inside that node)."""
    fp8_recipe: str = "delayed"
    """--fp8-recipe (fp8 runs): how each cast finds its scale (FP8_RECIPES)."""
    moe_a2a_overlap: bool = False
    """--overlap-moe-expert-parallel-comm (megatron-core's combined 1F1B): a micro-batch's token
    all-to-alls run under another micro-batch's compute, so a layer's exchange costs only what
    exceeds that layer's compute (expert_exchange_times)."""

    def __post_init__(self) -> None:
        if self.precision not in BYTES_PER_VALUE:
            raise HeteroError(f"precision {self.precision!r} is not one of {', '.join(BYTES_PER_VALUE)}")
        check_recompute(self.recompute)
        if self.virtual_stages < 1:
            raise HeteroError("virtual_stages must be at least 1")
        if self.fp8_recipe not in FP8_RECIPES:
            raise HeteroError(f"fp8_recipe {self.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise HeteroError(f"moe_dispatcher {self.moe_dispatcher!r} is not one of {', '.join(MOE_DISPATCHERS)}")

    @property
    def value_bytes(self) -> int:
        """Bytes of an activation, weight or message (fp8 runs keep them in bf16)."""
        return 2 if self.fp8_gemms else BYTES_PER_VALUE[self.precision]

    @property
    def fp8_gemms(self) -> bool:
        """Linear layers' GEMMs run in fp8 (transformer-engine's recipes)."""
        return self.precision == "fp8"

    @property
    def fp8_cast_bytes(self) -> int:
        """Bytes an fp8 linear layer's input cast moves per value (read, fp8 copy and its
        transpose, and the maximum's pass where the recipe has one)."""
        return FP8_CAST_BYTES_PER_VALUE + FP8_AMAX_PASS_BYTES_PER_VALUE.get(self.fp8_recipe, 0)

    @property
    def grad_bytes(self) -> int:
        if self.grad_reduce_dtype is not None:
            return BYTES_PER_VALUE[self.grad_reduce_dtype]
        # megatron-core DDP: grad_reduce_in_fp32 = --accumulate-allreduce-grads-in-fp32 or bf16
        return 4 if self.precision in ("bf16", "fp8", "fp32") else self.value_bytes

    @property
    def optimizer_bytes(self) -> int:
        """fp32 master weight (mixed precision only) and two Adam moments, per parameter."""
        return 12 if self.value_bytes < 4 else 8

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingSetup":
        """The fields this release knows, from a plan's training section."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
