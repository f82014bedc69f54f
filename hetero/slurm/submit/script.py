"""The batch script hetero-launch --slurm writes: #SBATCH lines per component, and a body that
runs the driver (hetero.slurm.driver) on the first node of component 0."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from hetero.slurm.submit.components import Component, single_job_sbatch
from hetero.slurm.submit.options import DEFAULT_MAX_RESTARTS, DEFAULT_POLL_S, LaunchOptions
from hetero.plan import Plan

DRIVER_MODULE = "hetero.slurm.driver"


def driver_command(run_dir: Path, options: LaunchOptions, train_args: Sequence[str]) -> list[str]:
    """The script's command: the driver, with the options that differ from its defaults."""
    command = [options.python, "-m", DRIVER_MODULE, "--run-dir", str(run_dir)]
    if options.max_restarts != DEFAULT_MAX_RESTARTS:
        command += ["--max-restarts", str(options.max_restarts)]
    if not options.readmit:
        command.append("--no-readmit")
    elif options.poll_s != DEFAULT_POLL_S:
        command += ["--poll-s", f"{options.poll_s:g}"]
    if options.master_port != 29500:
        command += ["--master-port", str(options.master_port)]
    if options.script != "pretrain_gpt.py":
        command += ["--script", options.script]
    if options.emulate_devices:
        command.append("--emulate-devices")
    for rule in options.env:
        command += ["--env", rule.text()]
    return command + ["--", *train_args]


def batch_script(plan_path: str, plan: Plan, components: list[Component], run_dir: Path,
                 options: LaunchOptions, train_args: Sequence[str]) -> str:
    """The heterogeneous batch script (one component per node class; a plain job for one class)."""
    name = options.job_name or f"hetero-{Path(plan_path).stem}"
    lines = [
        "#!/bin/bash",
        f"# Written by hetero-launch --slurm from {plan_path}: {plan.world_size} ranks on "
        f"{sum(len(c.hosts) for c in components)} nodes"
        + (" in one job." if options.layout == "single" else
           f" in {len(components)} component{'s' if len(components) > 1 else ''}."),
        "# The driver binds the plan's hosts to the allocated nodes, runs one torchrun per node (srun",
        "# steps), re-plans for the survivors after a lost node and writes driver.json here (docs/slurm.md).",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
    ]
    if options.layout == "single":
        lines += [f"# {component.describe()}" for component in components]
        lines.append("#SBATCH " + " ".join(_sbatch_word(o) for o in single_job_sbatch(components, options.partition,
                                                                                       options)))
    else:
        for component in components:
            if component.index:
                lines.append("#SBATCH hetjob")
            lines.append(f"# {component.describe()}")
            lines.append("#SBATCH " + " ".join(_sbatch_word(o) for o in component.sbatch))
    command = driver_command(run_dir, options, train_args)
    lines += [
        f"cd {shlex.quote(options.workdir)}",
        "export PYTHONUNBUFFERED=1",
        "exec " + " \\\n    ".join(_wrap(command)),
        "",
    ]
    return "\n".join(lines)


def _sbatch_word(option: str) -> str:
    """An option as an #SBATCH line takes it: no shell reads the line (`a100&80gb` stays as it
    is), and sbatch splits at whitespace outside double quotes."""
    return f'"{option}"' if any(c.isspace() for c in option) else option


def _wrap(command: list[str], width: int = 90) -> list[str]:
    """The command's words in lines of about width characters (a readable script), a flag
    and its value on one line."""
    words: list[str] = []
    for word in (shlex.quote(w) for w in command):
        if words and words[-1].startswith("-") and " " not in words[-1] and not word.startswith("-"):
            words[-1] += " " + word
        else:
            words.append(word)
    lines, current = [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return lines + ([current] if current else [])
