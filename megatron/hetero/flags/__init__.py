"""Every flag of Megatron-LM's pretrain_gpt.py, and what Megatron-Hetero does with it.

The facts (names, defaults, value kinds, groups) come from Megatron-LM's own parser at the
pinned tag (``facts``: megatron_lm_flags.json, written by tools/extract_megatron_flags.py).
Each flag has exactly one status (``rules``):

- honoured: arguments/ defines it, with Megatron-LM's meaning and default;
- no-op: accepted and reported once at start-up, where Megatron-LM ignores it too;
- refused: parsed with Megatron-LM's value syntax, then rejected BY NAME with what the
  feature is and what to do (``catalog`` holds the reasons).

A refused flag given with Megatron-LM's default value asks for nothing Megatron-LM would do
differently without it (``--cp-comm-type p2p``), so it is accepted as a no-op.

Modules: ``facts`` (Megatron-LM's flags), ``reads`` (where Megatron-LM's pretrain_gpt.py reads
each; the no-op rule), ``declare`` (honoured flags declared from the facts), ``catalog`` (our
rulings on the flags arguments/ does not honour), ``themes`` (the refused flags' themes and
their reasons), ``later_tags`` (a later tag's renamed and removed flags, read by the reference
tag's dests), ``rules`` (each flag's status), ``parsing`` (the parser side: recording, judging a
command line), ``typos`` ("did you mean"), ``docs`` (docs/flags.md and the counts).
Nothing here imports torch or megatron-core.
"""

from megatron.hetero.flags.catalog import DEFAULT_DIFFERENCES, HETERO_FLAGS
from megatron.hetero.flags.declare import declare
from megatron.hetero.flags.docs import FlagCounts, flag_counts, markdown, readme_block
from megatron.hetero.flags.facts import FACTS_FILE, MegatronFlag, megatron_flags, megatron_tag
from megatron.hetero.flags.parsing import (
    GIVEN,
    Verdict,
    add_megatron_flags,
    default_differences,
    defined_options,
    honoured_dests,
    judge,
    refusal_error,
    refused_values,
)
from megatron.hetero.flags.rules import Ruling, Status, check_registry, counts, rulings
from megatron.hetero.flags.typos import is_typo, suggest, unknown_flag_messages

__all__ = [
    "DEFAULT_DIFFERENCES", "FACTS_FILE", "GIVEN", "HETERO_FLAGS", "FlagCounts", "MegatronFlag",
    "Ruling", "Status", "Verdict", "add_megatron_flags", "check_registry", "counts",
    "declare", "default_differences", "defined_options", "flag_counts", "honoured_dests", "is_typo", "judge", "markdown",
    "megatron_flags", "megatron_tag", "readme_block", "refusal_error", "refused_values",
    "rulings", "suggest", "unknown_flag_messages",
]
