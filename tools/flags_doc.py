"""Writes docs/flags.md from the flag registry (megatron/hetero/flags/):

    python -m tools.flags_doc > docs/flags.md
    python -m tools.flags_doc --readme     # rewrites README.md's generated flag-count block

Every count of flags stated in docs/flags.md, --help and README.md comes from one function,
megatron.hetero.flags.flag_counts; tests/test_flags.py checks that the committed files are
what this prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.hetero import flags
from megatron.hetero.arguments import build_parser
from megatron.hetero.flags.docs import README_BEGIN, README_END

README = Path(__file__).resolve().parent.parent / "README.md"


def render() -> str:
    return flags.markdown(build_parser())


def readme_block() -> str:
    """The README's flag-count block: the markers and the sentence between them."""
    return flags.readme_block(build_parser())


def with_readme_block(text: str) -> str:
    """``text`` (README.md) with its generated block rewritten; an error if it has none."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"error: {README} has no generated flag-count block; put the two lines\n"
                         f"{README_BEGIN}\n{README_END}\nwhere the counts belong, then run this again")
    return text[:start] + readme_block() + text[end + len(README_END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.flags_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true",
                        help="rewrite the flag-count block of README.md instead of printing docs/flags.md")
    options = parser.parse_args(argv)
    if options.readme:
        README.write_text(with_readme_block(README.read_text()))
        print(f"wrote the flag counts into {README}")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
