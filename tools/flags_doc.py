"""Writes docs/flags.md from the flag registry (megatron/hetero/flags/):

    python -m tools.flags_doc > docs/flags.md
    python -m tools.flags_doc --readme     # rewrites README.md's generated flag-count block

docs/flags.md holds the reference Megatron-LM tag's table and a section per later tag (the flags
it added, with their status); each is rendered by a process using that tag's flags.

Every count of flags stated in docs/flags.md, --help and README.md comes from one function,
megatron.hetero.flags.flag_counts; tests/test_flags.py checks that the committed files are
what this prints.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from megatron.hetero import flags
from megatron.hetero.arguments import build_parser
from megatron.hetero.flags.docs import README_BEGIN, README_END, counts_sentence, later_tag_section
from megatron.hetero.flags.facts import FACTS_FILES, TAG_VARIABLE

README = Path(__file__).resolve().parent.parent / "README.md"
REFERENCE = next(iter(FACTS_FILES))


def _under(tag: str, what: str) -> str:
    """``what`` (table, section or counts) rendered by a process using ``tag``'s flags."""
    if flags.megatron_tag() == tag:
        return _here(what)
    return subprocess.run([sys.executable, "-m", "tools.flags_doc", "--part", what], check=True, capture_output=True,
                          text=True, cwd=README.parent, env={**os.environ, TAG_VARIABLE: tag}).stdout


def _here(what: str) -> str:
    if what == "table":
        return flags.markdown(build_parser())
    if what == "section":
        return later_tag_section(build_parser())
    return counts_sentence(flags.flag_counts(build_parser()))


def render() -> str:
    """docs/flags.md: the reference tag's table, then a section per later tag."""
    return _under(REFERENCE, "table") + "".join("\n" + _under(tag, "section") for tag in list(FACTS_FILES)[1:])


def readme_block() -> str:
    """The README's flag-count block: the markers and a sentence per tag between them."""
    sentences = [_under(tag, "counts").strip() for tag in FACTS_FILES]
    return "\n".join([README_BEGIN, " ".join(sentences), README_END])


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
    # One part, under the tag HETERO_MEGATRON_LM_TAG names (how render() builds the whole).
    parser.add_argument("--part", choices=["table", "section", "counts"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.part is not None:
        sys.stdout.write(_here(options.part))
        return 0
    if options.readme:
        README.write_text(with_readme_block(README.read_text()))
        print(f"wrote the flag counts into {README}")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
