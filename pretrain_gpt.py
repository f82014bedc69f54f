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
multi-node plan.
"""

if __name__ == "__main__":
    # Imports stay under the guard: helper processes that multiprocessing spawns (the
    # checkpoint writer's) re-import this file and need none of it.
    import gc
    import sys

    from megatron.hetero.pretrain import main

    exit_code = main(sys.argv[1:])
    # The interpreter's exit would otherwise walk every object torch and megatron-core
    # made in search of cycles: ~1.5 s of each process's 2-core life for nothing.
    gc.freeze()
    sys.exit(exit_code)
