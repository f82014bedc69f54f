"""Tokenizer, datasets and the per-replica sample order.

Iteration i consumes samples [i*G, (i+1)*G) of the dataset (G = global batch size)
whatever the plan: replica d takes the contiguous slice that starts after the
micro-batches of replicas 0..d-1. So the same global batch is trained on, and the same
update made, under any split of micro-batches between replicas.
"""

from __future__ import annotations

import argparse
import os
import signal
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from hetero.plan import Plan
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as _mcore_build


def build_tokenizer(args: argparse.Namespace):
    """megatron-core's tokenizer factory, fed the Megatron-LM flags it reads."""
    options = SimpleNamespace(
        tokenizer_type=args.tokenizer_type,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        tokenizer_metadata=None,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=True,
        tokenizer_hf_include_special_tokens=False,
        tokenizer_sentencepiece_legacy=False,
        trust_remote_code=False,
        tiktoken_pattern=None,
        tiktoken_num_special_tokens=1000,
    )
    try:
        return _mcore_build(options)
    except (OSError, AssertionError, ValueError) as err:
        raise HeteroError(
            f"could not build tokenizer {args.tokenizer_type}: {err}; check --vocab-file, "
            "--merge-file or --tokenizer-model"
        ) from None


def check_data_paths(args: argparse.Namespace) -> None:
    """Every --data-path prefix must name an existing .bin/.idx pair (checked before start-up)."""
    if not args.data_path:
        return
    try:
        prefixes, _ = get_blend_from_list(args.data_path)
    except ValueError as err:
        raise HeteroError(f"--data-path {' '.join(args.data_path)}: {err}") from None
    missing = [p for p in prefixes if not (os.path.isfile(f"{p}.bin") and os.path.isfile(f"{p}.idx"))]
    if missing:
        raise HeteroError(
            f"--data-path: no .bin/.idx pair at {', '.join(missing)}; give the prefix of files "
            "written by Megatron's preprocess_data.py (PREFIX.bin and PREFIX.idx)"
        )
    check_splits_can_serve(args)


def check_splits_can_serve(args: argparse.Namespace) -> None:
    """Every split the run reads holds at least one sample of every --data-path dataset.

    megatron-core repeats a split's documents for as many epochs as the samples asked of
    it need; a split of no tokens never gets there and its index builder loops forever.
    The document ranges follow megatron-core's own rule (the split matrix's book-ends
    times the number of documents, rounded).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    needed = num_samples_per_split(args)
    sample_tokens = args.seq_length + 1
    prefixes, _ = get_blend_from_list(args.data_path)
    for prefix in prefixes:
        index = IndexedDataset(prefix, mmap=True)
        # A copy: the array views the index's memory map, which is closed with `index`.
        lengths = np.array(index.sequence_lengths, dtype=np.int64)
        del index
        for name, bookends, samples in zip(("train", "validation", "test"), split_matrix, needed):
            if bookends is None or samples == 0:
                continue  # a split of share 0 is not built; the run skips what needs it
            begin, end = (int(round(b * len(lengths))) for b in bookends)
            tokens = int(lengths[begin:end].sum())
            if tokens >= sample_tokens:
                continue
            raise HeteroError(
                f"--data-path {prefix} with --split {args.split}: the {name} split gets documents "
                f"[{begin}, {end}) of {len(lengths)} ({tokens} tokens), not one sample of --seq-length "
                f"{args.seq_length} (+1) tokens, and the run needs {samples} samples from it; give that "
                "split a larger share in --split, use a larger dataset"
                + (", or --eval-iters 0" if name != "train" else ", or a shorter --seq-length")
            )


def num_samples_per_split(args: argparse.Namespace) -> list[int]:
    """Samples the run will read from train / validation / test (Megatron-LM's count)."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [
        args.train_iters * args.global_batch_size,
        evaluations * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def build_datasets(args: argparse.Namespace, tokenizer):
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    def build():
        return BlendedMegatronDatasetBuilder(
            dataset_type, num_samples_per_split(args), lambda: True, config
        ).build()

    # With an on-disk index cache, rank 0 writes it first and the others read it.
    if args.data_cache_path is None:
        return build()
    if dist.get_rank() == 0:
        datasets = build()
    dist.barrier()
    if dist.get_rank() != 0:
        datasets = build()
    return datasets


class ReplicaBatchSampler:
    """Index lists of this replica's micro-batches, iteration after iteration."""

    def __init__(self, dataset_size: int, plan: Plan, dp_rank: int, start_iteration: int = 0):
        self.dataset_size = dataset_size
        self.micro_batch_size = plan.micro_batch_size
        self.global_batch_size = plan.global_batch_size
        self.offset = plan.first_micro_batch(dp_rank) * plan.micro_batch_size
        self.num_micro_batches = plan.replicas[dp_rank].num_micro_batches
        self.start_iteration = start_iteration

    def __iter__(self) -> Iterator[list[int]]:
        # Whole iterations only: a replica must never run while another has run dry.
        iteration = self.start_iteration
        while (iteration + 1) * self.global_batch_size <= self.dataset_size:
            base = iteration * self.global_batch_size + self.offset
            for m in range(self.num_micro_batches):
                first = base + m * self.micro_batch_size
                yield list(range(first, first + self.micro_batch_size))
            iteration += 1


def reset_signals_in_worker(_worker_id: int = 0) -> None:
    """A DataLoader worker is forked from a rank whose watchdog owns SIGTERM/SIGINT and the
    signal wakeup socket; a signal reaching the worker after the rank closed that socket
    printed "OSError: [Errno 9] Bad file descriptor". Workers take default handling: their
    parent stops them."""
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def needs_data() -> bool:
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def micro_batch_iterator(
    dataset, plan: Plan, num_workers: int, start_iteration: int = 0
) -> Iterator[dict] | None:
    """This rank's micro-batches (None on stages that take no data)."""
    if dataset is None or not needs_data():
        return None
    sampler = ReplicaBatchSampler(
        len(dataset), plan, parallel_state.get_data_parallel_rank(), start_iteration
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=reset_signals_in_worker,
    )
    return iter(loader)
