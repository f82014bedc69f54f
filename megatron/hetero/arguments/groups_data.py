"""The parser's data-and-tokenizer group, and the data-path files read after parsing."""

from __future__ import annotations

import argparse

from hetero.errors import HeteroError
from megatron.hetero import flags


DATA_PATH_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
                   "--per-split-data-args-path")
_SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


def read_data_args_files(args: argparse.Namespace) -> None:
    """Megatron-LM's get_blend_and_blend_per_split, read up front: --data-args-path holds the
    --data-path arguments (whitespace-separated), --per-split-data-args-path a JSON object
    with "train", "valid" and "test" (each a list or a string of them). Afterwards only
    --data-path or --train/valid/test-data-path are set."""
    per_split_given = any(getattr(args, name) is not None for name in _SPLIT_PATHS)
    if args.data_args_path is not None:
        if args.data_path is not None:
            raise HeteroError("--data-args-path and --data-path both give the data; give one")
        args.data_path = _read_text(args.data_args_path, "--data-args-path").split()
    if args.per_split_data_args_path is not None:
        if per_split_given:
            raise HeteroError("--per-split-data-args-path and --train/valid/test-data-path both give "
                              "the data; give one")
        path = args.per_split_data_args_path
        try:
            import json

            given = json.loads(_read_text(path, "--per-split-data-args-path"))
            for split, name in zip(("train", "valid", "test"), _SPLIT_PATHS):
                value = given[split]
                setattr(args, name, value.split() if isinstance(value, str) else list(value))
        except (ValueError, KeyError, TypeError) as err:
            raise HeteroError(f"--per-split-data-args-path {path}: {err!r}; give a JSON object with "
                              "\"train\", \"valid\" and \"test\", each a list of [weight] prefix") from None
    if args.data_path is not None and any(getattr(args, name) is not None for name in _SPLIT_PATHS):
        raise HeteroError("--data-path and --train/valid/test-data-path (one dataset split by --split, or "
                          "one dataset per split): give one of them")
    if uses_split_paths(args) and args.split is not None:
        raise HeteroError("--split divides the --data-path dataset; with a dataset per split "
                          "(--train/valid/test-data-path) remove it")


def uses_split_paths(args: argparse.Namespace) -> bool:
    """A dataset per split (--train/valid/test-data-path) instead of --data-path with --split."""
    return any(getattr(args, name) for name in _SPLIT_PATHS)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as err:
        raise HeteroError(f"{flag} {path}: {err.strerror}; give the file holding the data paths") from None


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    # Megatron-LM's per-split datasets and files holding the data paths (read_data_args_files).
    flags.declare(g, DATA_PATH_FLAGS)
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic"],
                   help="single: each sample once, in order (default); cyclic: round the data for "
                        "ever, each pass shuffled by --seed (the same for every plan)")
    flags.declare(g, ("--full-validation",))  # data.ReplicaBatchSampler
    g.add_argument("--split", default=None, help="default 969,30,1 (Megatron-LM's)")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="let attention build its causal mask instead of the dataloader")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                            "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "Llama2Tokenizer", "TikTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                   help="TikTokenizer's split pattern (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
