"""`python -m hetero.launch ...` is hetero-launch."""

import sys

from hetero.launch.commands import main

sys.exit(main())
