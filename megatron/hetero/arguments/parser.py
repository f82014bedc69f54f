"""The parser (its groups in --help order, then the rest of Megatron-LM's flags), parsing,
and the honoured flags' values as megatron-core config fields."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Sequence

from hetero.errors import HeteroError
from megatron.hetero import flags
from megatron.hetero.flags.later_tags import fill_reference_dests
from megatron.hetero.arguments.config_fields import _add_config_field_args, _resolve_aliases
from megatron.hetero.arguments.groups_checkpoint import _add_checkpoint_args
from megatron.hetero.arguments.groups_data import _add_data_args
from megatron.hetero.arguments.groups_logging import _add_logging_args
from megatron.hetero.arguments.groups_model import _add_model_args, _add_moe_args
from megatron.hetero.arguments.groups_parallel import (_add_distributed_args, _add_hetero_args,
                                                       _add_performance_args)
from megatron.hetero.arguments.groups_training import _add_run_control_args, _add_training_args


def honoured_config_values(args: argparse.Namespace, fields: set[str]) -> dict:
    """Every honoured flag whose dest is one of ``fields`` (a megatron-core config's), with
    its value: what Megatron-LM's core_transformer_config_from_args copies."""
    return {dest: getattr(args, dest) for dest in sorted(honoured_dests() & fields) if hasattr(args, dest)}


def config_from_flags(config_class: type, args: argparse.Namespace, **decided):
    """``config_class`` (a megatron-core config dataclass) built as Megatron-LM builds its
    OptimizerConfig and TransformerConfig: every honoured flag whose dest is a field, then
    the ``decided`` fields, which take precedence."""
    fields = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{**honoured_config_values(args, fields), **decided})


@functools.cache
def honoured_dests() -> frozenset[str]:
    """The dests of the flags this parser honours (the same for every run)."""
    return frozenset(flags.honoured_dests(build_parser()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-LM compatible GPT pretraining under a heterogeneous plan.",
        usage="%(prog)s [flags of Megatron-LM's pretrain_gpt.py] [--hetero-plan PLAN.json]",
        allow_abbrev=False,
    )
    for add in (_add_model_args, _add_training_args, _add_run_control_args, _add_data_args,
                _add_logging_args, _add_checkpoint_args, _add_distributed_args, _add_moe_args,
                _add_config_field_args, _add_hetero_args, _add_performance_args):
        add(parser)
    flags.add_megatron_flags(parser)  # the rest of Megatron-LM's flags: no-op or refused
    return parser


def parse_args(argv: Sequence[str], refusals: list[HeteroError] | None = None) -> argparse.Namespace:
    """Parses flags. Every refused Megatron-LM flag and every unknown flag given is named in
    one HeteroError (appended to ``refusals`` when given, and the flags returned, so that
    start-up goes on to find the other problems); ``args.noop_flags`` lists the accepted
    no-ops for the start-up log. A value argparse cannot parse is a HeteroError too."""
    parser = build_parser()
    parser.exit_on_error = False  # reported with the other problems, not as a usage dump
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise HeteroError(f"{err}; `pretrain_gpt.py --help-all` lists every flag's values") from None
    args.noop_flags = []
    fill_reference_dests(args)  # under a later Megatron-LM tag: the dests it removed or renamed
    _resolve_aliases(args)
    try:
        flags.judge(parser, args, unknown)
    except HeteroError as err:
        if refusals is None:
            raise
        refusals.append(err)
    return args
