"""The tied word embedding's gradient sum between the first and the last pipeline stage.

With tied input and output embeddings (Megatron's default) and more than one stage, the
first stage holds the table and the last a copy; after the backward pass their gradients
are summed. Both the predictor and the planner's fast estimate price it here.

- Stages of one degree: megatron-core all-reduces each vocabulary shard between its two
  holders (its embedding group: first and last stage of one replica, same TP rank): a
  pair all-reduce of table / tp bytes, every pair at once.
- Stages of different degrees (megatron/hetero/stage_tensor_parallel.py TiedEmbeddingGrads):
  every rank of both stages puts its shard into a zeroed full table and all take part in
  one all-reduce of the whole table.
"""

from __future__ import annotations

from typing import Sequence

from hetero.predict.costs import CostModel


def tied_embedding_sync_s(costs: CostModel, first_hosts: Sequence[Sequence[str]],
                          last_hosts: Sequence[Sequence[str]]) -> float:
    """Seconds the tied table's gradient sum adds to the first and the last stage.

    first_hosts[d][t]: the host of replica d's first-stage rank of TP rank t; last_hosts
    likewise for the last stage (of a pipeline of two or more stages). 0 for untied models."""
    model = costs.model
    if model.untie_embeddings_and_output_weights:
        return 0.0
    table = model.vocab_size * model.hidden_size * costs.setup.grad_bytes
    first_degree, last_degree = len(first_hosts[0]), len(last_hosts[0])
    if first_degree == last_degree:
        return max(costs.group_allreduce([a, b], table / first_degree)
                   for firsts, lasts in zip(first_hosts, last_hosts) for a, b in zip(firsts, lasts))
    members = [h for hosts in first_hosts for h in hosts] + [h for hosts in last_hosts for h in hosts]
    return costs.group_allreduce(members, table)
