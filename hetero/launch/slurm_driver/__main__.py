"""python -m hetero.launch.slurm_driver: the body of the batch script (driver.py)."""

import sys

from hetero.launch.slurm_driver.driver import main

sys.exit(main())
