"""Writes docs/flags.md from the flag registry (megatron/hetero/flags.py):

    python -m tools.flags_doc > docs/flags.md

tests/test_flags.py checks that the committed file is what this prints.
"""

from __future__ import annotations

import sys

from megatron.hetero import flags
from megatron.hetero.arguments import build_parser


def render() -> str:
    return flags.markdown(build_parser())


if __name__ == "__main__":
    sys.stdout.write(render())
