"""``python -m megatron.hetero.patches``: lists the patches and which of them apply here."""

import sys

from megatron.hetero.core_version import ALLOW_UNTESTED_FLAG
from megatron.hetero.patches import describe

if __name__ == "__main__":
    print(describe(allow_untested=ALLOW_UNTESTED_FLAG in sys.argv[1:]))
