"""Command-line flags: Megatron-LM's names, defaults and meanings, plus ``--hetero-plan``.

The flags defined in this package are honoured (but for flags/catalog.py's DEFAULT_ONLY, which
run at Megatron-LM's default only). Every other flag of Megatron-LM's pretrain_gpt.py is known
too (megatron/hetero/flags/): a no-op where Megatron-LM ignores it, else refused by name with
the reason. A flag that is not Megatron-LM's is an error naming it, and so is a flag that
contradicts the plan.

The modules, by concept:

- ``parser``: ``build_parser`` (the groups below, in --help order, then the rest of
  Megatron-LM's flags), ``parse_args``, and the honoured flags as megatron-core config fields;
- ``groups_model``, ``groups_training``, ``groups_data``, ``groups_logging``,
  ``groups_checkpoint``, ``groups_parallel``: the groups of honoured flags, by theme;
- ``config_fields``: flags declared from Megatron-LM's facts (config fields, builder options,
  logging switches, other names), their groups and checks;
- ``validation`` and ``feature_checks``: ``validate_args``, the problems found after parsing;
- ``plan_checks``: the plan against the flags (``apply_plan``, ``check_plan_model``);
- ``vocabulary``: tensor-parallel degrees and the vocabulary padding.
"""

from __future__ import annotations

from megatron.hetero.arguments.config_fields import (
    ALIAS_FLAGS,
    CONFIG_FIELD_FLAGS,
    DATA_BUILDER_FLAGS,
    LOGGING_FLAGS,
    MODEL_BUILDER_FLAGS,
    apply_logging_level,
)
from megatron.hetero.arguments.feature_checks import grouped_gemm_available
from megatron.hetero.arguments.groups_data import DATA_PATH_FLAGS, read_data_args_files, uses_split_paths
from megatron.hetero.arguments.groups_logging import PROFILING_FLAGS
from megatron.hetero.arguments.groups_model import used_kernel_tuning_flags
from megatron.hetero.arguments.groups_training import RUN_CONTROL_FLAGS
from megatron.hetero.arguments.parser import (
    build_parser,
    config_from_flags,
    honoured_config_values,
    honoured_dests,
    parse_args,
)
from megatron.hetero.arguments.plan_checks import (
    apply_plan,
    check_moe_sequence_parallel,
    check_plan_model,
    check_precision_supported,
)
from megatron.hetero.arguments.validation import validate_args
from megatron.hetero.arguments.vocabulary import padded_vocab_size, tensor_parallel_sizes, vocab_divisor_giving

__all__ = [
    "ALIAS_FLAGS", "CONFIG_FIELD_FLAGS", "DATA_BUILDER_FLAGS", "DATA_PATH_FLAGS", "LOGGING_FLAGS",
    "MODEL_BUILDER_FLAGS", "PROFILING_FLAGS", "RUN_CONTROL_FLAGS", "apply_logging_level", "apply_plan",
    "build_parser", "check_moe_sequence_parallel", "check_plan_model", "check_precision_supported",
    "config_from_flags", "grouped_gemm_available", "honoured_config_values", "honoured_dests",
    "padded_vocab_size", "parse_args", "read_data_args_files", "tensor_parallel_sizes",
    "used_kernel_tuning_flags", "uses_split_paths", "validate_args", "vocab_divisor_giving",
]
