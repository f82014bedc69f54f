"""pretrain_gpt.py's help: ``--help`` is one screen, ``--help-all`` every flag.

``--help`` lists the honoured flags by theme, names only, with the flag counts and where
to read more; ``--help-all`` is argparse's full help (every Megatron-LM flag, the no-ops and
refusals with their reasons). Neither imports torch or megatron-core: pretrain_gpt.py asks
here before importing the runtime, so help answers in well under 2 s.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Sequence

SHORT = ("-h", "--help")
ALL = "--help-all"
_WIDTH = 100


def help_requested(argv: Sequence[str]) -> str | None:
    """"all" for --help-all, "short" for -h/--help (anywhere, as argparse), else None."""
    if ALL in argv:
        return "all"
    if any(arg in SHORT for arg in argv):
        return "short"
    return None


def _honoured_groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """(theme, its flags' first names) of the groups arguments/ defines: the flags that run
    (a flag refused at every value but Megatron-LM's default is left out)."""
    from megatron.hetero.flags import GIVEN  # the dest of the no-op and refused flags' groups

    groups = []
    for group in parser._action_groups:
        names = [action.option_strings[0] for action in group._group_actions
                 if action.option_strings and action.help is not argparse.SUPPRESS
                 and not (action.help or "").startswith("refused")
                 and action.option_strings[0] not in SHORT]
        if names and all(action.dest != GIVEN for action in group._group_actions):
            groups.append((group.title, names))
    return groups


def short_help(parser: argparse.ArgumentParser) -> str:
    from megatron.hetero.flags import flag_counts

    counts = flag_counts(parser)
    lines = [
        f"usage: {parser.usage.replace('%(prog)s', parser.prog)}",
        "",
        "GPT/Llama pretraining with megatron-core under a plan from hetero-plan (PLAN.json:",
        "degrees, layers per stage, micro-batches per replica, rank order); without a plan,",
        "Megatron's uniform layout. Megatron-LM's flags keep their names, defaults and meanings:",
        f"of its {counts.total} flags ({counts.tag}), {counts.honoured} are honoured (below), "
        f"{counts.noop} are accepted no-ops,",
        f"{counts.refused} are refused by name with the reason. Every problem of a launch is "
        "reported at once.",
        "",
        "Honoured flags, by theme:",
    ]
    for title, names in _honoured_groups(parser):
        head = f"  {title}: "
        if len(head) + len(names[0]) > _WIDTH:  # a long flag after a long title: title alone
            lines.append(head.rstrip())
            head = "    "
        lines += textwrap.wrap(" ".join(names), _WIDTH, initial_indent=head,
                               subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)
    lines += [
        "",
        "More: `pretrain_gpt.py --help-all` (every flag with its help, the no-ops and refusals",
        "with their reasons); docs/flags.md (each Megatron-LM flag's status); docs/faults.md",
        "(errors and exit codes).",
    ]
    return "\n".join(lines) + "\n"


def print_help(argv: Sequence[str]) -> int:
    """Prints the help ``argv`` asks for; the exit code (0)."""
    from megatron.hetero.arguments import build_parser

    parser = build_parser()
    if help_requested(argv) == "all":
        parser.print_help()
    else:
        print(short_help(parser), end="")
    return 0
