"""Log lines in Megatron-LM's format, so users' log parsers keep working."""

from __future__ import annotations

import math
import resource
import sys
from datetime import datetime

import torch
import torch.distributed as dist

from hetero.events import Memory


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_last_rank() -> bool:
    return not dist.is_initialized() or _rank() == dist.get_world_size() - 1


def _emit(message: str, stream=None) -> None:
    """One write per message: ranks share the launcher's pipe, and a single write of up to
    4 KiB to a pipe is never split by another process's output (print() may write the text
    and the newline separately)."""
    stream = stream or sys.stdout
    stream.write(message + "\n")
    stream.flush()


def print_all(message: str) -> None:
    _emit(message)


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        _emit(message)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        _emit(message)


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    tflops_per_device: float | None,
    tokens_per_second: float,
    learning_rate: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm: float | None,
    params_norm: float | None,
    num_zeros_in_grad: int | None,
    skipped_iterations: int,
    nan_iterations: int,
) -> str:
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops_per_device is not None:  # --log-throughput, as in Megatron-LM
        # Megatron prints one decimal; tiny models on a CPU need more to show anything.
        tflops = f"{tflops_per_device:.1f}" if tflops_per_device >= 1 else f"{tflops_per_device:.4f}"
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops} |"
    line += f" tokens per second: {tokens_per_second:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        line += f" num zeros: {num_zeros_in_grad} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped_iterations:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    return line


def arguments_block(args) -> str:
    """All flags after defaults were filled in, as Megatron-LM prints them at start-up."""
    lines = ["------------------------ arguments ------------------------"]
    for name, value in sorted(vars(args).items()):
        lines.append(f"  {name} {'.' * max(1, 48 - len(name))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def evaluation_block(prefix: str, losses: dict[str, float]) -> str:
    line = f" validation loss at {prefix} |"
    for key, value in losses.items():
        line += f" {key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} |"
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def memory_stats(rank: int, iteration: int) -> Memory:
    """This process's memory now, as the memory line reports it and the Memory event records it."""
    mb = 1024 * 1024
    if torch.cuda.is_available():
        return Memory(logical_rank=rank, iteration=iteration,
                      allocated_mb=torch.cuda.memory_allocated() / mb,
                      max_allocated_mb=torch.cuda.max_memory_allocated() / mb,
                      reserved_mb=torch.cuda.memory_reserved() / mb,
                      max_reserved_mb=torch.cuda.max_memory_reserved() / mb)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return Memory(logical_rank=rank, iteration=iteration, max_rss_mb=peak_kb / 1024,
                  mapped_files_mb=_mapped_files_kb() / 1024)


def memory_line(stats: Memory) -> str:
    """Megatron-LM's memory line (on the CPU: peak resident memory and the mapped files in it)."""
    head = f"[Rank {stats.logical_rank}] (after {stats.iteration} iterations) memory (MB) | "
    if stats.max_allocated_mb is not None:
        return (head + f"allocated: {stats.allocated_mb:.1f} | max allocated: {stats.max_allocated_mb:.1f} | "
                f"reserved: {stats.reserved_mb:.1f} | max reserved: {stats.max_reserved_mb:.1f}")
    return head + f"max rss: {stats.max_rss_mb:.1f} | mapped files: {stats.mapped_files_mb:.1f}"


def _mapped_files_kb() -> int:
    """Resident pages of mapped files (the libraries' code and data), now. Their number
    depends on the page cache (the same run reads 86 or 147 MB of them), not on the job;
    max rss minus this is the job's own peak, the CPU's "max allocated"."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def error(launch_rank: int, message: str) -> None:
    _emit(f"[launch rank {launch_rank}] error: {message}", sys.stderr)


class ProgressLog:
    """--log-progress: Megatron-LM's progress.txt in --save, one line per job start and per
    checkpoint saved, with the job's and the cumulative throughput (TFLOP/s per device,
    cumulative over every job of this world size that appended to the file)."""

    def __init__(self, save_dir: str | None, world_size: int, floating_point_operations_at_start: float):
        self.path = None if save_dir is None else f"{save_dir}/progress.txt"
        self.world_size = world_size
        self.operations_at_start = floating_point_operations_at_start
        self.started = datetime.now()

    def _append(self, text: str) -> None:
        if self.path is None or _rank() != 0:
            return
        import os

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        job_id = os.environ.get("SLURM_JOB_ID", "")
        with open(self.path, "a") as handle:
            handle.write(f"{datetime.now():%Y-%m-%d %H:%M:%S}\tJob ID: {job_id}\t# GPUs: {self.world_size}\t{text}\n")

    def job_started(self) -> None:
        self._append("Starting job")
        self.started = datetime.now()

    def _first_start(self) -> tuple[datetime, float]:
        """When the first job of this world size started (the run of jobs at this size), and
        the operations done before it, from the file itself."""
        start, operations, last_operations = self.started, self.operations_at_start, 0.0
        try:
            lines = open(self.path).read().splitlines()
        except OSError:
            return start, operations
        previous_size = None
        for line in lines:
            fields = line.split("\t")
            size = next((f.split(": ", 1)[1] for f in fields if f.startswith("# GPUs: ")), None)
            if fields[-1] == "Starting job" and size != previous_size:
                start, operations = datetime.strptime(fields[0], "%Y-%m-%d %H:%M:%S"), last_operations
            previous_size = size
            for field in fields:
                if field.startswith("Floating-point operations: "):
                    last_operations = float(field.split(": ", 1)[1])
        return start, operations

    def checkpoint_saved(self, iteration: int, operations_so_far: float, tokens_so_far: int) -> None:
        if self.path is None or _rank() != 0:
            return
        now = datetime.now()
        job = (operations_so_far - self.operations_at_start) / (
            max((now - self.started).total_seconds(), 1e-9) * 1e12 * self.world_size)
        first_start, first_operations = self._first_start()
        cumulative = (operations_so_far - first_operations) / (
            max((now - first_start).total_seconds(), 1e-9) * 1e12 * self.world_size)
        self._append(f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                     f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                     f"Floating-point operations: {operations_so_far:.2e}\t"
                     f"Tokens (in billions): {tokens_so_far / 10**9:.2f}")
