"""The job record: what a plan written by hetero-plan was made for, and what it predicted.

A plan's layout fields (hetero/plan.py) say how to run. hetero-plan adds five sections
that say for what, so the plan can be explained, checked at start-up and planned again
later (after a lost node, for another cluster):

- ``model``: the model's shape (ModelRecord; ModelSpec's fields, Megatron's names);
- ``training``: the global batch, sequence length and TrainingSetup's settings the plan
  was predicted with, and why that precision (TrainingRecord);
- ``cluster``: the cluster it was planned on (hetero.spec.cluster's ClusterSpec, the YAML's
  format), resolved when the plan is loaded so that a bad one is refused then;
- ``prediction``: the predictor's numbers, with the Megatron baseline and the upper bound
  when they were computed (PredictionRecord);
- ``provenance``: which tool wrote it, when, how long the search took (ProvenanceRecord).

Each is optional on Plan (a hand-written plan has none; a section given as null is one
left out) and read by attribute: ``plan.training.precision``, never by string key.
docs/plan-format.md lists every field.

Unknown keys. A key this release does not know is refused in ``model``, ``training`` and
``cluster``: they decide what runs and what is checked, so a misspelt or newer setting
must not be silently ignored. ``prediction`` and ``provenance`` are informational: unknown
keys there, as at the plan's top level, are kept and written back unchanged, so a plan from
a newer hetero-plan still loads.

Values. Numbers must be JSON numbers (a string or true is refused, not converted), finite,
and within bounds that no real job reaches (MAX_COUNT, MAX_DIMENSION, MAX_AMOUNT): a larger
value is a corrupted file, and refusing it here keeps every later step (lists sized by it,
loops over it) from running out of memory or time.

Sections are written as they were read (Plan.to_dict: exactly the keys given), so plans
round-trip byte for byte and ``prediction.baseline: null`` (no uniform Megatron plan fits)
stays null.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, model_validator

from hetero.errors import HeteroError
from hetero.spec.cluster import Cluster, ClusterSpec
from hetero.spec.model import ModelSpec
from hetero.spec.recompute import check as check_recompute

MAX_COUNT = 1 << 20
"""Bound on counts (ranks, parallel degrees, layers, micro-batches, devices): a million."""
MAX_DIMENSION = 2**31 - 1
"""Bound on model sizes (hidden size, vocabulary, sequence length): int32's range."""
MAX_AMOUNT = 1e12
"""Bound (exclusive) on predicted amounts: 10^12 s is 30,000 years, and no device or cluster
reaches 10^12 tokens/s, GiB or TFLOPS."""

Count = Annotated[int, Field(strict=True, ge=1, le=MAX_COUNT)]
"""A count (degree, layers, micro-batches): a JSON integer (not "2", 2.0 or true) from 1 to MAX_COUNT."""
Dimension = Annotated[int, Field(strict=True, ge=1, le=MAX_DIMENSION)]
Precision = Literal["bf16", "fp16", "fp8", "fp32"]


def _amount(value: object) -> int | float:
    # bool is an int to Python and "1.5" would parse: neither is a number the tool wrote.
    # int stays int so that the file is written back as it was read.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 <= value < MAX_AMOUNT):
        raise ValueError(f"must be a finite number from 0 up to (not including) {MAX_AMOUNT:.0e}; got {value!r}")
    return value


Amount = Annotated[int | float, PlainValidator(_amount)]


def _recompute_name(value: str) -> str:
    try:
        return check_recompute(value)
    except HeteroError as e:
        raise ValueError(str(e)) from None


RecomputeName = Annotated[str, AfterValidator(_recompute_name)]
"""none, full, selective or selective:MODULE,... (hetero/spec/recompute.py)."""
"""A predicted time (s), rate, memory size (GiB) or ratio: non-negative, finite, < MAX_AMOUNT."""
PerDevice = dict[str, Amount]
"""An amount per device type (catalog name)."""


class _Section(BaseModel):
    """A section that decides what runs: unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Informational(_Section):
    """A section a person reads: unknown keys kept and written back."""

    model_config = ConfigDict(extra="allow", strict=True)


# ----- model ----------------------------------------------------------------------------


class ModelRecord(_Section):
    """``model``: the model the plan was made for, with ModelSpec's (Megatron's) field names.
    pretrain_gpt.py refuses a run whose flags build another model."""

    num_layers: Dimension = Field(description="decoder layers (the stages' num_layers sum to it)")
    hidden_size: Dimension
    num_attention_heads: Dimension
    seq_length: Dimension
    vocab_size: Dimension = Field(description="padded vocabulary: the embedding table's rows")
    ffn_hidden_size: Dimension | None = Field(default=None, description="default: 4h, 2/3 of it (to 64) with SwiGLU")
    num_query_groups: Dimension | None = Field(default=None, description="key/value heads; default: one per head")
    kv_channels: Dimension | None = Field(default=None, description="per-head size; default: hidden / heads")
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    max_position_embeddings: Dimension | None = Field(default=None, description="default: seq_length")
    num_experts: Dimension | None = Field(default=None, description="experts per MoE layer; null: a dense MLP")
    moe_router_topk: Dimension = Field(default=2, description="experts each token is routed to")
    moe_ffn_hidden_size: Dimension | None = Field(default=None, description="default: ffn_hidden_size")
    moe_shared_expert_intermediate_size: Dimension | None = Field(
        default=None, description="shared experts' total FFN width; null: none")
    moe_router_num_groups: Dimension | None = Field(
        default=None, description="group-limited routing: expert groups (--moe-router-num-groups); null: none")
    moe_router_group_topk: Dimension | None = Field(
        default=None, description="groups a token's experts come from (--moe-router-group-topk)")
    moe_layer_freq: Dimension | list[Literal[0, 1]] = Field(
        default=1, description="every k-th layer is MoE, or one 0/1 per layer (--moe-layer-freq)")
    mtp_num_layers: Dimension | None = Field(default=None, description="multi-token prediction layers")
    multi_latent_attention: bool = False
    q_lora_rank: Dimension | None = Field(default=None, description="MLA query rank; null: full rank")
    kv_lora_rank: Dimension = 32
    qk_head_dim: Dimension = 128
    qk_pos_emb_head_dim: Dimension = 64
    v_head_dim: Dimension = 128
    # A JSON array of two (a list in Python) read as the pair it is: strict mode refuses a list
    # where a tuple is declared, which every plan from JSON would give.
    window_size: Annotated[tuple[Annotated[int, Field(strict=True, ge=-1)], Annotated[int, Field(strict=True, ge=-1)]],
                           BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)] | None = Field(
        default=None, description="sliding-window attention: keys before and after a query (--window-size); "
        "null: full attention")
    window_attn_skip_freq: Dimension | list[Literal[0, 1]] | None = Field(
        default=None, description="with a window: every N-th layer attends fully, or one 1 (window) / 0 (full) "
        "per layer (--window-attn-skip-freq)")

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelRecord":
        # What Megatron-LM refuses too; refused here so that explain never divides by zero.
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}; give kv_channels")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_query_groups {self.num_query_groups} does not divide num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk} is more than num_experts {self.num_experts}")
        return self

    @classmethod
    def of(cls, spec: ModelSpec) -> "ModelRecord":
        return cls(**spec.to_dict())

    def spec(self) -> ModelSpec:
        """The model, Megatron's defaults filled in (for fields left out)."""
        return ModelSpec(**self.model_dump(exclude_none=True))


# ----- training -------------------------------------------------------------------------


class TrainingRecord(_Section):
    """``training``: how the job runs beyond the layout. Every field but global_batch_size,
    seq_length and precision_reason is a field of hetero.predict.training_setup.TrainingSetup (with
    its default): the settings the prediction assumed."""

    global_batch_size: Annotated[int, Field(strict=True, ge=1, le=MAX_DIMENSION)]
    seq_length: Dimension
    precision: Precision = Field(description="bf16, fp16, fp8 or fp32 (neither --bf16 nor --fp16)")
    distributed_optimizer: bool = True
    fused_kernels: bool = True
    dropout: bool = True
    recompute: RecomputeName = Field(
        default="none", description="the job's recomputation: none, full, selective (the attention core) or "
        "selective:MODULE,... (--recompute-modules); a stage's own setting overrides it")
    sequence_parallel: bool = False
    virtual_stages: Count = Field(default=1, description="model chunks per pipeline stage")
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_dtype: Precision | None = Field(default=None, description="null: Megatron's default")
    scatter_stage_transfers: bool = False
    fused_softmax: bool | None = Field(default=None, description="null: as fused_kernels")
    tp_comm_overlap: bool = Field(default=False, description="tensor-parallel communication priced as overlapped "
                                  "with the GEMMs (--tp-comm-overlap); the runtime does not switch it on yet")
    moe_dispatcher: Literal["alltoall", "flex"] = Field(
        default="alltoall", description="the MoE token dispatcher priced (flex: DeepEP/HybridEP, a token "
        "sent once per node; the runtime runs alltoall)")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = Field(
        default="delayed", description="--fp8-recipe priced for fp8 runs (tensorwise reads each GEMM input "
        "once more for its maximum)")
    moe_a2a_overlap: bool = Field(default=False, description="expert all-to-alls priced as overlapped with "
                                  "another micro-batch's compute (--overlap-moe-expert-parallel-comm); the "
                                  "runtime does not switch it on")
    precision_reason: str | None = Field(default=None, description="why this precision, for a person")
    tokenizer_vocab_size: Dimension | None = Field(
        default=None, description="the tokenizer's vocabulary before padding (plans from Megatron flags)")
    make_vocab_size_divisible_by: Dimension | None = Field(
        default=None, description="the --make-vocab-size-divisible-by that pads it to the model's vocab_size "
        "at this plan's tensor-parallel degrees")

    JOB_FIELDS: ClassVar[tuple[str, ...]] = ("global_batch_size", "seq_length", "precision_reason",
                                             "tokenizer_vocab_size", "make_vocab_size_divisible_by")
    """The fields that are not TrainingSetup's."""

    def setup_fields(self) -> dict:
        """TrainingSetup's arguments (defaults for those left out)."""
        return {name: getattr(self, name) for name in type(self).model_fields if name not in self.JOB_FIELDS}


# ----- prediction -----------------------------------------------------------------------


class UpperBoundRecord(_Informational):
    """What every device type trained alone would reach, summed (hetero.search.baseline)."""

    tokens_per_s: Amount
    per_device_type: PerDevice | None = None


class BaselineRecord(_Informational):
    """The best uniform plan stock Megatron-LM runs on the same devices."""

    devices: str = Field(description="which devices it uses, for a person")
    tensor_parallel: Count
    pipeline_parallel: Count
    data_parallel: Count
    micro_batch_size: Count
    recompute: RecomputeName
    iteration_time_s: Amount
    tokens_per_s: Amount
    dollars_per_million_tokens: Amount | None = Field(default=None, description="null: a device has no price")
    joules_per_token: Amount | None = Field(default=None, description="at board power; null: unknown power")


class PredictionRecord(_Informational):
    """``prediction``: the predictor's numbers for this plan when it was written (hetero-plan
    explain predicts again from the recorded job)."""

    iteration_time_s: Amount
    tokens_per_s: Amount
    tflops_per_device: PerDevice | None = None
    peak_memory_gib: PerDevice | None = None
    memory_capacity_gib: PerDevice | None = None
    pipeline_s: Amount | None = Field(default=None, description="the pipeline's end, before the reduction")
    gradient_reduction_s: list[Amount] | None = Field(default=None, description="per stage")
    optimizer_s: Amount | None = None
    fits_in_memory: bool | None = None
    upper_bound: UpperBoundRecord | None = None
    fraction_of_upper_bound: Amount | None = None
    baseline: BaselineRecord | None = Field(
        default=None, description="null: no uniform Megatron plan fits; left out: not computed")
    speedup_over_baseline: Amount | None = None
    dollars_per_million_tokens: Amount | None = Field(default=None, description="null: a device has no price")
    joules_per_token: Amount | None = Field(default=None, description="at board power; null: unknown power")
    objective: str | None = Field(default=None, description="what the plan was chosen for, for a person")

    @model_validator(mode="after")
    def _check_pairs(self) -> "PredictionRecord":
        # Written together; the report prints each pair on one line.
        if self.upper_bound is not None and self.fraction_of_upper_bound is None:
            raise ValueError("upper_bound is given without fraction_of_upper_bound")
        if self.baseline is not None and self.speedup_over_baseline is None:
            raise ValueError("baseline is given without speedup_over_baseline")
        return self


# ----- provenance -----------------------------------------------------------------------


def _timestamp(value: str) -> str:
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"must be an ISO 8601 time such as 2026-01-31T12:00:00+00:00; got {value!r}") from None
    return value


class ProvenanceRecord(_Informational):
    """``provenance``: who wrote the plan, when, and how the search went."""

    tool: str = Field(min_length=1, description="e.g. hetero-plan 0.1.0")
    created: Annotated[str, AfterValidator(_timestamp)] = Field(description="ISO 8601, UTC")
    family: str | None = Field(default=None, description="the kind of replicas the planner chose")
    search_time_s: Amount | None = None
    total_time_s: Amount | None = None
    candidates_estimated: Annotated[int, Field(strict=True, ge=0, lt=MAX_AMOUNT)] | None = None
    profiles: str | None = Field(default=None, description="the profiles directory; null: the catalog")


# ----- cluster --------------------------------------------------------------------------


def check_cluster(spec: ClusterSpec) -> ClusterSpec:
    """The cluster section resolved (devices known, hosts unique, groups linked), its size
    bounded before any list of its hosts is built."""
    devices = sum(node.num_nodes * node.count for group in spec.groups for node in group.nodes)
    if devices > MAX_COUNT:
        raise ValueError(f"{devices} devices (num_nodes x count summed) is more than {MAX_COUNT}")
    try:
        Cluster(spec, spec.name)
    except HeteroError as err:
        raise ValueError(str(err)) from None
    return spec


ClusterSection = Annotated[ClusterSpec, AfterValidator(check_cluster)]


SECTIONS = ("model", "training", "cluster", "prediction", "provenance")
"""The job record's sections, in the order hetero-plan writes them."""
