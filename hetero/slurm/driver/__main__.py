"""python -m hetero.slurm.driver: the body of the batch script (driver.py)."""

import sys

from hetero.slurm.driver.driver import main

sys.exit(main())
