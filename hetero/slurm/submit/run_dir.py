"""The run directory of a Slurm job (on storage every node sees): plan.json (the plan as
given), launch.json (the components, for the driver) and job.sbatch; the driver adds its
plans, events and driver.json."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from hetero.errors import HeteroError
from hetero.io import write_json_atomic
from hetero.slurm.submit.components import Component
from hetero.slurm.submit.options import LaunchOptions

PLAN_FILE = "plan.json"
LAUNCH_FILE = "launch.json"
SCRIPT_FILE = "job.sbatch"


def default_run_dir(plan_path: str) -> Path:
    """hetero-runs/<plan>-<time>, absolute (the job starts elsewhere)."""
    return (Path("hetero-runs") / f"{Path(plan_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()


def write_run_dir(run_dir: Path, plan_path: str, components: list[Component], script: str,
                  options: LaunchOptions) -> None:
    """Writes the run directory; refuses one that already holds a job."""
    if (run_dir / SCRIPT_FILE).exists():
        raise HeteroError(f"{run_dir} already holds a job ({SCRIPT_FILE}); pick another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plan_path, run_dir / PLAN_FILE)
    except OSError as err:
        raise HeteroError(f"cannot write the run directory {run_dir}: {err}; pick another --run-dir") from None
    write_json_atomic(run_dir / LAUNCH_FILE, {
        "plan": PLAN_FILE,
        "source_plan": str(Path(plan_path).absolute()),
        "workdir": options.workdir,
        "python": options.python,
        "partition": options.partition,
        "account": options.account,
        "layout": options.layout,
        "components": [c.to_dict() for c in components],
    })
    (run_dir / SCRIPT_FILE).write_text(script)
    (run_dir / SCRIPT_FILE).chmod(0o755)


def load_launch(run_dir: Path) -> tuple[dict, list[Component]]:
    """launch.json of a run directory: (its settings, the components)."""
    path = run_dir / LAUNCH_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HeteroError(f"{path} does not exist: --run-dir must be the directory hetero-launch --slurm "
                          "wrote") from None
    except json.JSONDecodeError as err:
        raise HeteroError(f"{path} is not valid JSON ({err}); write the run directory again with "
                          "hetero-launch --slurm") from None
    return data, [Component.from_dict(c) for c in data["components"]]
