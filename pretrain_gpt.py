"""Pretrain a GPT/Llama model with megatron-core under a heterogeneous plan.

Takes Megatron-LM's pretrain_gpt.py flags, plus --hetero-plan plan.json:

    # one process, no plan (Megatron's uniform layout)
    python pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 2 --global-batch-size 16 --train-iters 10 \\
        --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000

    # four processes under a plan written by hetero-plan (uneven stages, unequal replicas,
    # reordered ranks): the same flags, plus the plan
    torchrun --nproc-per-node 4 pretrain_gpt.py --hetero-plan plan.json ...

`python -m hetero.launch plan.json -- ARGS` prints the per-node torchrun commands of a
multi-node plan. `--help` lists the honoured flags by theme, `--help-all` every flag.
"""

if __name__ == "__main__":
    # Imports stay under the guard: helper processes that multiprocessing spawns (the
    # checkpoint writer's) re-import this file and need none of it.
    import atexit
    import gc
    import os
    import sys

    def _quiet_teardown() -> None:
        """Registered first, so it runs after every other exit handler: megatron-core 0.17+
        imports triton, whose bindings report each of its objects still alive when the
        interpreter is torn down as a leak (~80 lines on stderr), and gc.freeze() below keeps
        them all alive. Only that teardown's output goes to /dev/null."""
        if "triton" in sys.modules:
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)

    atexit.register(_quiet_teardown)
    from megatron.hetero.cli_help import help_requested, print_help

    if help_requested(sys.argv[1:]):  # answered before torch is imported: well under 2 s
        sys.exit(print_help(sys.argv[1:]))
    from megatron.hetero.pretrain import main

    exit_code = main(sys.argv[1:])
    if exit_code == 2:
        # Bad input, reported; nothing left to write. All ranks leave together, and torchrun
        # stops with SIGTERM a rank still tearing down when another's exit reaches it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    # The interpreter's exit would otherwise walk every object torch and megatron-core
    # made in search of cycles: ~1.5 s of each process's 2-core life for nothing.
    gc.freeze()
    sys.exit(exit_code)
