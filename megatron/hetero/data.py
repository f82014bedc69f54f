"""Tokenizer, datasets and the per-replica sample order.

Iteration i consumes the next global batch of samples, [i*G, (i+1)*G) of the dataset
(G = global batch size; with --rampup-batch-size the sizes of the ramp) whatever the plan: replica d takes the contiguous slice that starts after the
micro-batches of replicas 0..d-1. So the same global batch is trained on, and the same
update made, under any split of micro-batches between replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from hetero.errors import HeteroError
from hetero.spec.megatron_args import null_tokenizer_ids
from hetero.plan import Plan
from megatron.hetero.patches import import_megatron_core

import_megatron_core()  # megatron-core's first import defers its import-time torch.compile calls
from megatron.core import parallel_state
from megatron.hetero.identity import this_rank
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.hetero.batch_schedule import BatchSchedule


# The package each tokenizer type needs (optional extras of megatron-hetero).
TOKENIZER_PACKAGES = {
    "GPT2BPETokenizer": ("transformers", "tokenizers"),
    "HuggingFaceTokenizer": ("transformers", "tokenizers"),
    "SentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "GPTSentencePieceTokenizer": ("sentencepiece", "sentencepiece"),
    "Llama2Tokenizer": ("sentencepiece", "sentencepiece"),
    "TikTokenizer": ("tiktoken", "tiktoken"),
}
# The files each tokenizer type reads.
TOKENIZER_FILES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
}


def check_tokenizer(args: argparse.Namespace) -> None:
    """The package and files the tokenizer needs, checked before start-up."""
    import importlib.util

    package, extra = TOKENIZER_PACKAGES.get(args.tokenizer_type, (None, None))
    if package and importlib.util.find_spec(package) is None:
        raise HeteroError(
            f"--tokenizer-type {args.tokenizer_type} needs the {package} package: "
            f"pip install {package} (or megatron-hetero[{extra}])")
    for name in TOKENIZER_FILES.get(args.tokenizer_type, ()):
        flag = "--" + name.replace("_", "-")
        path = getattr(args, name)
        if path is None:
            raise HeteroError(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
        if args.tokenizer_type != "HuggingFaceTokenizer" and not os.path.exists(path):
            raise HeteroError(f"{flag} {path}: no such file")


def _hf_use_fast(args: argparse.Namespace) -> bool:
    """Whether a Hugging Face tokenizer loads its fast implementation."""
    return not getattr(args, "tokenizer_hf_no_use_fast", False)


def _gpt2_bpe_tokenizer(vocab_file: str, merge_file: str, use_fast: bool = True,
                        include_special_tokens: bool = False):
    """Megatron-LM's GPT2BPETokenizer: byte-level BPE from exactly these two files.

    megatron-core 0.16.1 builds it as HuggingFace's "gpt2" with the vocabulary overridden,
    which fetches the rest from the Hub (and drops the merge file); here the two files are
    staged as a local HuggingFace GPT-2 tokenizer, read by megatron-core's HuggingFace
    wrapper, with <|endoftext|> as end of document as in Megatron-LM. The staging directory
    is named by the files' content: every rank builds the same tokenizer description, so
    the dataset index caches (keyed by it) are shared.
    """
    import hashlib
    import json
    import tempfile

    from megatron.core.tokenizers import MegatronTokenizer

    with open(vocab_file, "rb") as vocab, open(merge_file, "rb") as merges:
        contents = {"vocab.json": vocab.read(), "merges.txt": merges.read()}
    eod = "<|endoftext|>"
    contents["tokenizer_config.json"] = json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": eod, "eos_token": eod,
         "unk_token": eod, "add_prefix_space": False}).encode()
    digest = hashlib.sha256(b"".join(contents.values())).hexdigest()[:16]
    directory = os.path.join(tempfile.gettempdir(), f"megatron-hetero-gpt2-bpe-{digest}")
    os.makedirs(directory, exist_ok=True)
    for name, data in contents.items():
        target = os.path.join(directory, name)
        if not os.path.exists(target):  # ranks of one host may race: write, then rename
            staging = f"{target}.{os.getpid()}.tmp"
            with open(staging, "wb") as handle:
                handle.write(data)
            os.replace(staging, target)
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=directory, metadata_path={"library": "huggingface"}, use_fast=use_fast,
        include_special_tokens=include_special_tokens)


class NullTokenizer:
    """Megatron-LM's NullTokenizer (synthetic data): ids are the text's integers; the
    vocabulary and the end-of-document id are the installed megatron-core's Megatron-LM's
    (hetero.spec.megatron_args.null_tokenizer_ids: one id past --vocab-size at core_v0.16.1,
    the last of --vocab-size ids from core_v0.19.0 on, which also takes
    --null-tokenizer-eod-id and --null-tokenizer-pad-id).

    Ours, not megatron-core's: importing that one imports megatron-core's tokenizer package,
    which imports every tokenizer library installed (transformers, sentencepiece, tiktoken:
    ~1.3 s and ~30 MB in every process) for a tokenizer that needs none of them.
    """

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int | None = None):
        self.vocab_size, self.eod = null_tokenizer_ids(int(vocab_size), eod_id)
        # megatron-core's datasets mask the labels equal to tokenizer.pad (-1: none, their default)
        self.pad = -1 if pad_id is None else int(pad_id)
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(token) for token in ids)


def build_tokenizer(args: argparse.Namespace):
    """megatron-core's tokenizer factory, fed the Megatron-LM flags it reads."""
    check_tokenizer(args)
    if args.tokenizer_type == "NullTokenizer":
        return NullTokenizer(args.vocab_size, getattr(args, "null_tokenizer_eod_id", None),
                             getattr(args, "null_tokenizer_pad_id", None))
    from megatron.hetero.core_compat import core_build_tokenizer, tokenizer_options

    build = core_build_tokenizer()
    options = tokenizer_options(
        tokenizer_type=args.tokenizer_type,
        vocab_size=args.vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        # Megatron-LM's tokenizer flags (their defaults where a caller's namespace lacks them).
        tokenizer_metadata=getattr(args, "tokenizer_metadata", None),
        tokenizer_special_tokens=getattr(args, "tokenizer_special_tokens", None),
        # Fast unless core_v0.19.0's --tokenizer-hf-no-use-fast says otherwise (core_v0.16.1's
        # --tokenizer-hf-use-fast is a no-op: the fast one always).
        tokenizer_hf_use_fast=_hf_use_fast(args),
        tokenizer_hf_include_special_tokens=getattr(args, "tokenizer_hf_include_special_tokens", False),
        tokenizer_sentencepiece_legacy=getattr(args, "tokenizer_sentencepiece_legacy", False),
        tokenizer_sentencepiece_ignore_extra_whitespaces=getattr(
            args, "tokenizer_sentencepiece_ignore_extra_whitespaces", True),
        chat_template=getattr(args, "chat_template", None),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
    )
    try:
        if args.tokenizer_type == "GPT2BPETokenizer":
            return _gpt2_bpe_tokenizer(args.vocab_file, args.merge_file, use_fast=options.tokenizer_hf_use_fast,
                                       include_special_tokens=options.tokenizer_hf_include_special_tokens)
        return build(options)
    except (OSError, AssertionError, ValueError) as err:
        raise HeteroError(
            f"could not build tokenizer {args.tokenizer_type}: {err}; check --vocab-file, "
            "--merge-file or --tokenizer-model"
        ) from None


def _data_path_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    return {flag: paths for flag, paths in (
        ("--data-path", args.data_path), ("--train-data-path", args.train_data_path),
        ("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path)) if paths}


def blends(args: argparse.Namespace) -> tuple:
    """megatron-core's blend and blend_per_split, as Megatron-LM's get_blend_and_blend_per_split
    makes them (data-args files were read into the path flags by validate_args)."""
    if args.mock_data:
        return None, None
    if args.data_path:
        return get_blend_from_list(args.data_path), None
    return None, [get_blend_from_list(paths) if paths else None
                  for paths in (args.train_data_path, args.valid_data_path, args.test_data_path)]


def check_data_paths(args: argparse.Namespace) -> None:
    """Every data prefix must name an existing .bin/.idx pair (checked before start-up)."""
    for flag, paths in _data_path_flags(args).items():
        try:
            prefixes, _ = get_blend_from_list(paths)
        except ValueError as err:
            raise HeteroError(f"{flag} {' '.join(paths)}: {err}") from None
        missing = [p for p in prefixes if not (os.path.isfile(f"{p}.bin") and os.path.isfile(f"{p}.idx"))]
        if missing:
            raise HeteroError(
                f"{flag}: no .bin/.idx pair at {', '.join(missing)}; give the prefix of files "
                "written by Megatron's preprocess_data.py (PREFIX.bin and PREFIX.idx)"
            )
    if args.data_path:
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
    # Only whether a split serves any sample matters here, so the ramp can be ignored.
    needed = num_samples_per_split(args, args.train_iters * args.global_batch_size)
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


def num_samples_per_split(args: argparse.Namespace, train_samples: int) -> list[int]:
    """Samples the run will read from train / validation / test (Megatron-LM's count)."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [
        train_samples,
        # --full-validation: the validation split as it is (one pass, megatron-core's None).
        None if args.full_validation else evaluations * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def full_validation_iters(args: argparse.Namespace, valid_samples: int) -> int:
    """--full-validation: the evaluation iterations that read the whole validation split, in
    whole global batches (the remainder is left out, as Megatron-LM's sampler drops it)."""
    iterations = valid_samples // args.global_batch_size
    if iterations < 1:
        raise HeteroError(f"--full-validation: the validation split holds {valid_samples} samples, "
                          f"fewer than one global batch ({args.global_batch_size}); give it more data")
    return iterations


def _sequences_per_dataset(path: str | None) -> dict | None:
    """--per-dataset-sequences-path: a JSON file of each dataset prefix's sequence count."""
    if path is None:
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as err:
        raise HeteroError(f"--per-dataset-sequences-path {path}: {err}; give a JSON file mapping "
                          "each --data-path prefix to its number of sequences") from None


def build_datasets(args: argparse.Namespace, tokenizer, train_samples: int):
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        **dict(zip(("blend", "blend_per_split"), blends(args))),
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # Megatron-LM's default builds the causal mask in the dataloader; the flag
        # --no-create-attention-mask-in-dataloader leaves it to attention.
        create_attention_mask=args.create_attention_mask_in_dataloader or args.reset_attention_mask,
        # Megatron-LM's pretrain_gpt.py passes these dataset flags through unchanged.
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        sequences_per_dataset=_sequences_per_dataset(args.per_dataset_sequences_path),
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    def build():
        return BlendedMegatronDatasetBuilder(
            dataset_type, num_samples_per_split(args, train_samples), lambda: True, config
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
    """Index lists of this replica's micro-batches, iteration after iteration.

    Iteration i reads samples [consumed(i), consumed(i) + G(i)) whatever the plan; replica d
    takes its micro-batches' share after those of replicas 0..d-1. G is the plan's global
    batch, or the ramp step's with --rampup-batch-size (split in the plan's proportions).
    """

    def __init__(self, dataset_size: int, plan: Plan, dp_rank: int, start_iteration: int = 0,
                 schedule: BatchSchedule | None = None, cyclic_seed: int | None = None,
                 repeat_after: int | None = None):
        self.dataset_size = dataset_size
        self.micro_batch_size = plan.micro_batch_size
        self.dp_rank = dp_rank
        self.schedule = schedule or BatchSchedule(plan)
        self.start_iteration = start_iteration
        # --dataloader-type cyclic: the stream of samples goes round the dataset for ever, each
        # pass in a new order drawn from (seed, pass) - the same for every plan.
        self.cyclic_seed = cyclic_seed
        self._order: tuple[int, torch.Tensor] | None = None
        # --full-validation: the first repeat_after samples, in order, again and again (each
        # evaluation reads them all once).
        self.repeat_after = repeat_after

    def _sample(self, position: int) -> int:
        if self.repeat_after is not None:
            return position % self.repeat_after
        if self.cyclic_seed is None:
            return position
        epoch, offset = divmod(position, self.dataset_size)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.cyclic_seed + epoch)
            self._order = (epoch, torch.randperm(self.dataset_size, generator=generator))
        return int(self._order[1][offset])

    def __iter__(self) -> Iterator[list[int]]:
        # Whole iterations only: a replica must never run while another has run dry.
        consumed = self.schedule.consumed_samples(self.start_iteration)
        while True:
            global_batch = self.schedule.global_batch_size(consumed)
            if self.cyclic_seed is None and self.repeat_after is None and consumed + global_batch > self.dataset_size:
                return
            counts = self.schedule.micro_batches(global_batch)
            first = consumed + sum(counts[: self.dp_rank]) * self.micro_batch_size
            for m in range(counts[self.dp_rank]):
                start = first + m * self.micro_batch_size
                yield [self._sample(position) for position in range(start, start + self.micro_batch_size)]
            consumed += global_batch


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
    dataset, plan: Plan, num_workers: int, start_iteration: int = 0,
    schedule: BatchSchedule | None = None, cyclic_seed: int | None = None, repeat_after: int | None = None,
) -> Iterator[dict] | None:
    """This rank's micro-batches (None on stages that take no data); cyclic_seed: in a new
    shuffled order each pass, for ever (--dataloader-type cyclic); repeat_after: the first
    that many samples, over and over (--full-validation)."""
    if dataset is None or not needs_data():
        return None
    sampler = ReplicaBatchSampler(
        len(dataset), plan, this_rank().replica, start_iteration, schedule, cyclic_seed,
        repeat_after)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=reset_signals_in_worker,
    )
    return iter(loader)
