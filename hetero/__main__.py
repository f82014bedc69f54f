"""`python -m hetero ...` is hetero-plan."""

import sys

from hetero.cli import main

sys.exit(main())
