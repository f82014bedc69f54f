"""torchrun with a plain ending: ``python -m megatron.hetero.launcher [torchrun's flags] SCRIPT ...``.

torchrun re-raises any worker's non-zero exit as its own ``ChildFailedError``, so every
failed job ends in torchrun's Python traceback and a failure summary of ~35 lines, even when
the workers printed exactly what was wrong and exited 2 (bad input). No worker can prevent
that (a worker's TORCHELASTIC_ERROR_FILE only changes one field of the summary, which
pretrain.py fills with a pointer to its message). This module runs torchrun's own launch
(same flags, agent, rendezvous and restarts) and ends instead with one line per exit code,
saying what it means, and exits with the first failure's code (torchrun exits 1 whatever the
workers' codes). ``hetero-launch --run`` starts a node this way.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

# pretrain_gpt.py's exit codes (docs/faults.md)
MEANINGS = {
    1: "a lost rank, launcher or store, or a crash; the ranks' messages are above",
    2: "bad input: the problems and their fixes are printed above",
}
_SIGNAL_BASE = 128


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"launch ranks {ranks[0]}-{ranks[-1]}"
    return ("launch rank " if len(ranks) == 1 else "launch ranks ") + ", ".join(map(str, ranks))


def summary(exit_codes: dict[int, int], script: str) -> list[str]:
    """One line per exit code of the failed ranks (launch rank -> code; negative: a signal)."""
    by_code: dict[int, list[int]] = {}
    for rank, code in sorted(exit_codes.items()):
        by_code.setdefault(code, []).append(rank)
    lines = []
    others_exited = any(code > 0 for code in by_code)
    for code, ranks in by_code.items():
        if code < 0:
            import signal

            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            what = f"were killed by {name}" if len(ranks) > 1 else f"was killed by {name}"
            if code == -signal.SIGTERM and others_exited:  # torchrun stops the rest when one fails
                what += " (torchrun stops the other ranks once one has failed)"
        else:
            meaning = MEANINGS.get(code) or (f"stopped by signal {code - _SIGNAL_BASE}" if code > _SIGNAL_BASE
                                             else "see the output above")
            what = f"exited with code {code} ({meaning})"
        lines.append(f"{script}: {_ranks(ranks)} {what}")
    return lines


def _quiet_torchrun_failure_line(record: logging.LogRecord) -> bool:
    # torchrun logs "failed (exitcode: N) local_rank: ..." before raising; our summary says it.
    return not str(record.msg).startswith("failed (exitcode")


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    options = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_quiet_torchrun_failure_line)
    try:
        run(options)  # torchrun's main, without its @record wrapper (which only re-raises)
    except ChildFailedError as failed:
        codes = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        for line in summary(codes, os.path.basename(failed.name)):
            print(line, file=sys.stderr, flush=True)
        _, first = failed.get_first_failure()
        code = first.exitcode
        return code if code > 0 else _SIGNAL_BASE - code
    return 0


if __name__ == "__main__":
    sys.exit(main())
