"""What a model's shape costs: FLOPs, parameters and activation bytes.

FLOPs per token as Megatron-LM counts them (num_floating_point_operations), parameters in
megatron-core's layout, activations after Korthikanti et al. 2022. The runtime (TFLOPS in the
log line) and the predictor both count with these, so they agree.
"""

from __future__ import annotations

import functools

from hetero.spec.recompute import mode as recompute_mode, modules as recomputed_modules


class ModelCosts:
    """The cost arithmetic of ModelSpec (hetero/spec/model.py), mixed into it: reads its
    fields and shape views (head_dim, is_moe, moe_layer_fraction, window_layer_pattern,
    mtp_layer_model, ...). Methods cached with functools.cache rely on the spec being frozen."""

    def _attention_widths(self) -> tuple[int, int, int]:
        """(query, key, value) widths over all heads (MLA: with the rotary part)."""
        if self.multi_latent_attention:
            qk = self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
            return qk, qk, self.num_attention_heads * self.v_head_dim
        return self.num_attention_heads * self.head_dim, self.query_groups * self.head_dim, self.query_groups * self.head_dim

    # ----- FLOPs ------------------------------------------------------------------------

    def _mlp_weights(self, ffn: int) -> int:
        return self.hidden_size * ffn * (3 if self.swiglu else 2)

    def attention_gemm_flops_per_token(self) -> float:
        """QKV and output projections (forward, per token); MLA's down and up projections as
        Megatron-LM counts them (num_floating_point_operations)."""
        h = self.hidden_size
        if self.multi_latent_attention:
            heads = self.num_attention_heads
            qk = self.qk_head_dim + self.qk_pos_emb_head_dim
            query = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + heads * qk + 1)
            key_value = self.kv_lora_rank * (h + heads * (self.qk_head_dim + self.v_head_dim) + 1)
            return 2 * (query + key_value + h * self.qk_pos_emb_head_dim + heads * self.v_head_dim * h)
        q, kv, _ = self._attention_widths()
        return 2 * h * (q + 2 * kv) + 2 * q * h

    def mla_up_projection_flops_per_token(self) -> float:
        """MLA's up projections (forward, per token): the query's from its latent (with a
        q_lora_rank) and the keys' and values' from theirs, what megatron-core's mla_up_proj
        recomputation runs again. 0 without MLA."""
        if not self.multi_latent_attention:
            return 0.0
        heads = self.num_attention_heads
        query = 0 if self.q_lora_rank is None else self.q_lora_rank * heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        return 2 * (query + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim))

    def attended_keys_per_query(self) -> float:
        """Keys a query attends, averaged over the queries and the layers: causal, so s / 2
        with full attention (as Megatron-LM counts it); a window of w earlier keys caps it at
        w + 1 (the keys after a query are masked by causality either way)."""
        s = self.seq_length
        full = s / 2
        pattern = self.window_layer_pattern()
        if not any(pattern):
            return full
        w = min(self.window_size[0], s - 1) if self.window_size[0] >= 0 else s - 1
        windowed = min(full, (w * (w + 1) / 2 + (s - w) * (w + 1)) / s)  # queries 0..w-1 see fewer
        share = sum(pattern) / len(pattern)
        return share * windowed + (1 - share) * full

    def core_attention_flops_per_token(self) -> float:
        """Scores and their product with V; causal, so half of the s x s matrix, as fused
        kernels compute it. Model FLOPs as Megatron-LM counts them, which ignores a sliding
        window (the cost model prices the attended keys: attended_keys_per_query)."""
        heads = self.num_attention_heads
        if self.multi_latent_attention:  # QK^T over the q/k width, the product with V over v's
            return 2 * self.seq_length * heads * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim) / 2
        return 2 * 2 * self.seq_length * heads * self.head_dim / 2

    def dense_mlp_flops_per_token(self) -> float:
        return 2 * self._mlp_weights(self.ffn)

    def moe_mlp_flops_per_token(self) -> float:
        """The top-k routed experts and the shared experts (the router's h x E GEMM is not
        counted, as Megatron-LM does not)."""
        return 2 * (self.moe_router_topk * self._mlp_weights(self.moe_ffn_hidden_size)
                    + self._mlp_weights(self.shared_expert_ffn))

    def mlp_flops_per_token(self) -> float:
        """Dense MLP, or the average over the layers of dense and MoE MLPs."""
        if self.is_moe:
            share = self.moe_layer_fraction
            return share * self.moe_mlp_flops_per_token() + (1 - share) * self.dense_mlp_flops_per_token()
        return self.dense_mlp_flops_per_token()

    @functools.cache
    def layer_forward_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one decoder layer's forward pass, per token."""
        return (self.attention_gemm_flops_per_token() + self.core_attention_flops_per_token()
                + self.mlp_flops_per_token())

    def logits_forward_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def mtp_forward_flops_per_token(self) -> float:
        """Multi-token prediction: each MTP layer is a decoder layer of the last layer's kind,
        a 2h -> h projection (with its norms) and another output layer."""
        if not self.mtp_num_layers:
            return 0.0
        h = self.hidden_size
        last_is_moe = self.moe_layer_pattern()[-1]
        mlp = self.moe_mlp_flops_per_token() if last_is_moe else self.dense_mlp_flops_per_token()
        layer = self.attention_gemm_flops_per_token() + self.core_attention_flops_per_token() + mlp
        return self.mtp_num_layers * (layer + 2 * (3 * h + 2 * h * h) + self.logits_forward_flops_per_token())

    def training_flops(self, num_samples: int) -> float:
        """Model FLOPs of forward + backward (2x forward) over num_samples sequences
        (recomputation not counted: it is the same model's work done twice)."""
        tokens = num_samples * self.seq_length
        forward = tokens * (
            self.num_layers * self.layer_forward_flops_per_token()
            + self.logits_forward_flops_per_token() + self.mtp_forward_flops_per_token()
        )
        return 3 * forward

    # ----- parameters -------------------------------------------------------------------

    @functools.cache
    def layer_params(self) -> int:
        """Parameters of one decoder layer (megatron-core's layout); a MoE layer holds
        every expert and the router."""
        h = self.hidden_size
        norms = 2 * h * (2 if self.normalization == "LayerNorm" else 1)
        return self.attention_params() + norms + self.mlp_params()

    def attention_params(self) -> int:
        h = self.hidden_size
        if self.multi_latent_attention:  # the FLOPs above are 2 x these weights, less the core
            return int((self.attention_gemm_flops_per_token()) / 2)
        q, kv, _ = self._attention_widths()
        return h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if self.add_bias_linear else 0)

    def _one_mlp_params(self, ffn: int) -> int:
        if ffn == 0:
            return 0
        fc1_out = ffn * (2 if self.swiglu else 1)
        return self._mlp_weights(ffn) + (fc1_out + self.hidden_size if self.add_bias_linear else 0)

    @functools.cache
    def expert_params(self) -> float:
        """Routed experts' parameters of the average layer: what expert parallelism shares
        out (every expert of every MoE layer, averaged over the layers)."""
        if not self.is_moe:
            return 0.0
        return self.moe_layer_fraction * self.num_experts * self._one_mlp_params(self.moe_ffn_hidden_size)

    @functools.cache
    def mlp_params(self) -> float:
        """The average layer's MLP: the dense MLP, or every expert, the shared experts and
        the router of a MoE layer, mixed as the layers are."""
        if self.is_moe:
            share = self.moe_layer_fraction
            moe = (self.num_experts * self._one_mlp_params(self.moe_ffn_hidden_size)
                   + self._one_mlp_params(self.shared_expert_ffn) + self.hidden_size * self.num_experts)
            dense = self._one_mlp_params(self.ffn)
            mixed = share * moe + (1 - share) * dense
            return int(mixed) if mixed == int(mixed) else mixed
        return self._one_mlp_params(self.ffn)

    @functools.cache
    def embedding_params(self) -> int:
        """Word (and learned position) embeddings: the first stage's extra parameters."""
        positions = 0
        if self.position_embedding_type == "learned_absolute":
            positions = self.max_position_embeddings * self.hidden_size
        return self.vocab_size * self.hidden_size + positions

    @functools.cache
    def output_params(self) -> int:
        """Final norm and output layer: the last stage's extras.

        With tied embeddings the last stage of a pipeline still holds its own copy of the
        table (kept in sync by an all-reduce), so it counts in memory either way.
        """
        final_norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return final_norm + self.vocab_size * self.hidden_size

    def mtp_params(self) -> float:
        """Multi-token prediction layers (their output layer shares the main one's weights)."""
        if not self.mtp_num_layers:
            return 0.0
        h = self.hidden_size
        return self.mtp_num_layers * (self.mtp_layer_model().layer_params() + 2 * h * h + 3 * h)

    def mtp_expert_params(self) -> float:
        """The routed experts among mtp_params (shared out by expert parallelism)."""
        if not self.mtp_num_layers:
            return 0.0
        return self.mtp_num_layers * self.mtp_layer_model().expert_params()

    def total_params(self) -> float:
        output = self.output_params()
        if not self.untie_embeddings_and_output_weights:
            output -= self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params() + self.embedding_params() + output + self.mtp_params()

    # ----- activations ------------------------------------------------------------------

    def layer_activation_bytes(
        self, micro_batch_size: int, tensor_parallel: int, bytes_per_value: int,
        fused_kernels: bool = True, dropout: bool = True, recompute: str = "none",
        sequence_parallel: bool = False,
    ) -> float:
        """Activations one layer keeps for backward, per micro-batch, after Korthikanti et
        al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
        4, table 2), generalised to GQA, SwiGLU and MoE.

        MHA, 4h MLP, 16-bit values, dropout, unfused attention, no recomputation:
        s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes; sequence parallelism splits the 10 by t as
        well (34*s*b*h/t + 5*a*s^2*b/t); selective recomputation drops the attention score
        terms (as fused/flash attention does: no s x s matrix kept); full recomputation
        keeps only each layer's input, 2*s*b*h (/t with sequence parallelism). Without
        dropout no masks or dropout outputs are kept. A MoE layer keeps its MLP
        activations for each of the top-k experts a token visits. Selective recomputation of
        other megatron-core modules (hetero/spec/recompute.py) drops what each rebuilds.
        """
        h, s, t, v = self.hidden_size, self.seq_length, tensor_parallel, bytes_per_value
        tokens = s * micro_batch_size
        if recompute_mode(recompute) == "full":
            return tokens * v * h / (t if sequence_parallel else 1)
        again = recomputed_modules(recompute)  # selective: what is rebuilt, not kept
        q, k, value = self._attention_widths()
        masks = 2 * h if dropout else 0  # after attention and after the MLP, one byte each
        # Split by TP only with sequence parallelism: two norm inputs, QKV and fc1 inputs
        # (the norms' outputs, which layernorm recomputation discards), dropout masks.
        sequence_part = (2 if "layernorm" in again else 4) * v * h + masks

        def mlp_bytes(ffn: int, activation_recomputed: bool = False) -> float:
            # MLP activation input(s) and fc2 input (the activation's output, which moe_act
            # recomputation discards)
            fc2_input = 0 if activation_recomputed else v * ffn
            if self.swiglu and not fused_kernels:
                return v * 4 * ffn + fc2_input  # fc1 output (2F), SiLU output and up half (F each)
            return v * (2 if self.swiglu else 1) * ffn + fc2_input

        # Split by TP: Q, K, V, attention output, MLP activation input(s), fc2 input. A
        # recomputed (checkpointed) MLP, MoE layer or shared expert keeps only its input.
        mlp = 0.0 if "mlp" in again else mlp_bytes(self.ffn)
        if self.is_moe:
            share = self.moe_layer_fraction
            routed = self.moe_router_topk * mlp_bytes(self.moe_ffn_hidden_size, "moe_act" in again)
            shared = 0.0 if again & {"shared_experts", "moe"} else mlp_bytes(self.shared_expert_ffn)
            moe = 0.0 if "moe" in again else routed + shared
            mlp = share * moe + (1 - share) * mlp
        output = self.num_attention_heads * (self.v_head_dim if self.multi_latent_attention else self.head_dim)
        # mla_up_proj recomputation rebuilds queries, keys and values from their latents.
        attention_inputs = 0 if "mla_up_proj" in again and self.multi_latent_attention else v * (q + k) + v * value
        split = attention_inputs + v * output + mlp
        scores = 0.0
        if not fused_kernels and "core_attn" not in again:
            # softmax output, and with dropout its mask and output
            scores = (2 * v + 1 if dropout else v) * self.num_attention_heads * s
        per_token = sequence_part / (t if sequence_parallel else 1) + (split + scores) / t
        return tokens * per_token

    def logits_activation_bytes(self, micro_batch_size: int, tensor_parallel: int, bytes_per_value: int) -> float:
        """The last stage's extra: logits (model dtype) and fp32 softmax for the loss."""
        tokens = self.seq_length * micro_batch_size
        return tokens * (self.vocab_size / tensor_parallel * (bytes_per_value + 4) + 2 * self.hidden_size)
