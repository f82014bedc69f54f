"""What a pipeline stage runs per micro-batch beyond its decoder layers (StageEndCosts, part
of CostModel): the first stage's batch and embedding, the last stage's output layer and
loss, and the multi-token-prediction layers megatron-core runs after them.
"""

from __future__ import annotations

from hetero.spec.cluster import Cluster
from hetero.predict.fixed_costs import end_kernel_gaps_s
from hetero.predict.training_setup import TrainingSetup
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles


class StageEndCosts:
    """CostModel's costs of the pipeline's ends (a mixin: CostModel supplies the attributes
    below, the memo and the layer costs)."""

    cluster: Cluster
    model: ModelSpec
    setup: TrainingSetup
    profiles: Profiles
    expert_parallel: int
    expert_tensor_parallel: int | None

    def stage_extra_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int,
                          first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) a stage spends per micro-batch beyond its decoder layers: the
        first reads the batch and runs the embedding, the last reads the labels and runs the
        output layer and loss, and the multi-token-prediction layers (mtp_times). A profile
        measures the ends as "logits" (a one-stage model); its embedding share, when
        measured, goes to the first stage, the rest to the last (a profile without the share
        puts it all on the last, as earlier releases did)."""
        if not (first or last):
            return 0.0, 0.0
        forward, backward = self._stage_ends_s(device_name, tensor_parallel, micro_batch_size, first, last)
        if last:
            mtp = self.mtp_times(device_name, tensor_parallel, micro_batch_size)
            forward, backward = forward + mtp[0], backward + mtp[1]
        return forward, backward

    def _stage_ends_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int,
                      first: bool, last: bool) -> tuple[float, float]:
        profile = self._compute_profile(device_name)
        if profile is not None:
            entry, scale = Profiles.entry(profile, tensor_parallel, micro_batch_size)
            if entry.logits_forward_s is not None and entry.logits_backward_s is not None:
                whole = entry.logits_forward_s, entry.logits_backward_s
                split = entry.embedding_forward_s is not None and entry.embedding_backward_s is not None
                if first and last:
                    part = whole
                elif not split:
                    part = whole if last else (0.0, 0.0)
                elif first:
                    part = (entry.batch_s or 0.0) + entry.embedding_forward_s, entry.embedding_backward_s
                else:
                    part = max(0.0, whole[0] - entry.embedding_forward_s), max(0.0, whole[1] - entry.embedding_backward_s)
                return part[0] * scale, part[1] * scale
        m, v = self.model, self.setup.value_bytes
        tokens = m.seq_length * micro_batch_size
        forward = backward = 0.0
        if first:  # a lookup and the position embedding's add; backward writes the table's dense gradient
            forward += self._memory_s(device_name, 3 * tokens * m.hidden_size * v)
            backward += self._memory_s(device_name, tokens * m.hidden_size * v + m.vocab_size / tensor_parallel
                                       * m.hidden_size * self.setup.grad_bytes)
        if last:
            logits = self._logits_s(device_name, tensor_parallel, micro_batch_size)
            forward, backward = forward + logits, backward + 2 * logits
        gaps = end_kernel_gaps_s(first, last)
        return forward + gaps[0], backward + gaps[1]

    def _logits_s(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> float:
        """The output layer's GEMM and the loss (logits to fp32, softmax), forward."""
        m, tokens = self.model, self.model.seq_length * micro_batch_size
        vocab = m.vocab_size / tensor_parallel
        return (self._gemm_s(device_name, tokens, vocab, m.hidden_size)
                + self._memory_s(device_name, tokens * vocab * (self.setup.value_bytes + 4) * 2))

    def mtp_layer_costs(self) -> "StageEndCosts":
        """The cost model (a CostModel like this one) of one multi-token-prediction layer: the
        model's last layer kind (a MoE layer for DeepSeek-V3, whose average layer mixes in
        three dense ones)."""
        kind = self.model.mtp_layer_model()
        if kind is self.model:
            return self
        return self._memo(("mtp kind",), lambda: type(self)(
            self.cluster, kind, self.setup, self.profiles, self.expert_parallel, self.expert_tensor_parallel))

    def mtp_times(self, device_name: str, tensor_parallel: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) of the multi-token-prediction layers, which megatron-core runs
        on the last pipeline stage after the loss's hidden states, per micro-batch. Each is a
        decoder layer of the last layer's kind (its expert exchange priced inside a node; the
        predictor adds what crosses nodes, mtp_exchange_layers), the 2h -> h projection of
        the shifted token's embedding beside the hidden state, with their norms and the
        embedding lookup, and another output layer and loss. A measured layer stands in for
        the MTP layer where the device is profiled."""
        m = self.model
        if not m.mtp_num_layers:
            return 0.0, 0.0
        host = next(n.host for n in self.cluster.nodes if n.device.name == device_name)
        kind = self if self._compute_profile(device_name) is not None else self.mtp_layer_costs()
        layer = kind.layer_cost(device_name, host, tensor_parallel, micro_batch_size)
        tokens, h, v = m.seq_length * micro_batch_size, m.hidden_size, self.setup.value_bytes
        split = tensor_parallel if self.setup.sequence_parallel else 1
        projection = (self._linear_s(device_name, tokens, h / tensor_parallel, 2 * h)
                      # the lookup, two norms (read, write) and the concatenation, over the hidden width
                      + self._memory_s(device_name, tokens * v * h * (3 + 2 * 2 + 4) / split))
        ends = projection + self._logits_s(device_name, tensor_parallel, micro_batch_size)
        gaps = end_kernel_gaps_s(False, True)
        return (m.mtp_num_layers * (layer.forward_s + ends + gaps[0]),
                m.mtp_num_layers * (layer.backward_s + 2 * ends + gaps[1]))

    def mtp_exchange_layers(self) -> float:
        """The multi-token-prediction layers' expert exchange, in units of the average layer's
        (which weighs a MoE layer's by the MoE share): what the last stage adds to its layer
        count where the predictor prices the exchange beyond a node."""
        m = self.model
        if not m.mtp_num_layers or not m.is_moe or not m.moe_layer_pattern()[-1]:
            return 0.0
        return m.mtp_num_layers / m.moe_layer_fraction
