"""How long the pieces of one training iteration take on given devices and links: the one
cost model. The predictor composes its functions for every rank of a plan; the planner's
fast estimate calls the very same functions for a few representative ranks.

CostModel is one object over four homes, one concept each:
- training_setup.py: how the job runs (TrainingSetup: precision, kernels, overlaps);
- layer_costs.py: one decoder layer's compute, recomputation and TP communication;
- stage_end_costs.py: the embedding, output layer, loss and MTP layers at the pipeline's ends;
- communication_costs.py: stage transfers, gradient reduction, all-reduces, all-to-alls;
and here the caches they share, activation sizes and the optimizer step.
"""

from __future__ import annotations

import dataclasses

from hetero.spec.cluster import Cluster, Route
from hetero.predict.communication_costs import CommunicationCosts
from hetero.predict.fixed_costs import iteration_fixed_s
from hetero.predict.layer_costs import LayerCosts
from hetero.predict.stage_end_costs import StageEndCosts
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles

# Bytes an Adam step touches per parameter: fp32 grad (4), master weight read+write (8),
# two moments read+write (16), model-dtype weight write (2-4).
ADAM_BYTES_PER_PARAM = 32


class CostModel(LayerCosts, StageEndCosts, CommunicationCosts):
    """Every cost of one job's setup on one cluster, with its profiles and expert grid;
    results are cached per argument tuple."""

    def __init__(self, cluster: Cluster, model: ModelSpec, setup: TrainingSetup,
                 profiles: Profiles | None = None, expert_parallel: int = 1,
                 expert_tensor_parallel: int | None = None):
        self.cluster, self.model, self.setup = cluster, model, setup
        self.precision = setup  # value_bytes, grad_bytes
        self.profiles = profiles or Profiles()
        # The plan's expert grid (Plan.expert_parallel / expert_tensor_parallel; None: each
        # stage's tensor-parallel degree). Costs that depend on it live on a sibling model
        # per grid (with_experts), so every cache below stays keyed as before.
        self.expert_parallel, self.expert_tensor_parallel = expert_parallel, expert_tensor_parallel
        self._cache: dict[tuple, object] = {}
        self._allreduce_cache: dict[tuple, tuple[float, float]] = {}
        self._route_cache: dict[tuple, Route] = {}
        self._siblings: dict[tuple, CostModel] = {(expert_parallel, expert_tensor_parallel): self}

    def with_experts(self, expert_parallel: int, expert_tensor_parallel: int | None = None) -> "CostModel":
        """This cost model for a plan with this expert grid (the same model when it is ours)."""
        key = (expert_parallel, expert_tensor_parallel)
        if key not in self._siblings:
            sibling = CostModel(self.cluster, self.model, self.setup, self.profiles,
                                expert_parallel, expert_tensor_parallel)
            sibling._siblings = self._siblings
            sibling._route_cache, sibling._allreduce_cache = self._route_cache, self._allreduce_cache
            self._siblings[key] = sibling
        return self._siblings[key]

    def with_virtual_stages(self, virtual_stages: int) -> "CostModel":
        """This cost model for a pipeline of this many model chunks per stage (a template of
        a plan of several runs its own interleaving; memory keeps more in flight)."""
        if virtual_stages == self.setup.virtual_stages:
            return self
        key = ("virtual stages", virtual_stages, self.expert_parallel, self.expert_tensor_parallel)
        if key not in self._siblings:
            sibling = CostModel(self.cluster, self.model, dataclasses.replace(self.setup, virtual_stages=virtual_stages),
                                self.profiles, self.expert_parallel, self.expert_tensor_parallel)
            sibling._route_cache, sibling._allreduce_cache = self._route_cache, self._allreduce_cache
            self._siblings[key] = sibling
        return self._siblings[key]

    def expert_tensor_parallel_at(self, tensor_parallel: int) -> int:
        """The expert tensor-parallel degree of a stage of this tensor-parallel degree."""
        return self.expert_tensor_parallel or tensor_parallel

    def expert_data_parallel_at(self, tensor_parallel: int, data_parallel: int) -> int:
        """Copies of each expert shard in a stage (its TP x DP ranks over EP x ETP)."""
        return max(1, tensor_parallel * data_parallel
                   // (self.expert_parallel * self.expert_tensor_parallel_at(tensor_parallel)))

    def _memo(self, key: tuple, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def activation_bytes(self, micro_batch_size: int) -> float:
        """One micro-batch's hidden states (s x b x h), whole."""
        return self.model.seq_length * micro_batch_size * self.model.hidden_size * self.setup.value_bytes

    def activation_message_bytes(self, micro_batch_size: int, tensor_parallel: int = 1) -> float:
        """What one tensor-parallel rank sends across a pipeline boundary per micro-batch:
        the whole activation, or 1/TP of it when transfers are scattered."""
        whole = self.activation_bytes(micro_batch_size)
        if self.setup.scatter_stage_transfers or self.setup.sequence_parallel:
            return whole / tensor_parallel
        return whole

    def optimizer_step(self, device_name: str, params: float) -> float:
        """A rank's optimizer step over the `params` it steps (with the distributed optimizer,
        its 1/DP share), with what each iteration adds around it: measured (the profile's
        megatron-core step per parameter, and its fixed part: the step's own work and the
        token-count, loss and gradient-norm all-reduces), else Adam's memory traffic and the
        fixed costs (fixed_costs.py)."""
        profile = self._compute_profile(device_name)
        if profile is not None and profile.optimizer_step_s_per_param is not None:
            return params * profile.optimizer_step_s_per_param + (profile.optimizer_step_fixed_s or 0.0)
        layers = params / max(1, self.model.layer_params())
        return self._memory_s(device_name, params * ADAM_BYTES_PER_PARAM) + iteration_fixed_s(layers)
