"""Megatron-LM's tokenizers through their real packages, on tiny files the tests build."""

import numpy as np
import pytest
import torch

import tiny_tokenizers
from conftest import GPT_MODEL, TRAINING, run_pretrain
from hetero.errors import HeteroError
from megatron.hetero.arguments import parse_args
from megatron.hetero.data import build_tokenizer


def _flags(kind: str, directory) -> list[str]:
    if kind == "GPT2BPETokenizer":
        vocab, merges = tiny_tokenizers.gpt2_bpe_files(directory)
        return ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-model", str(tiny_tokenizers.huggingface_dir(directory))]
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return ["--tokenizer-model", str(tiny_tokenizers.sentencepiece_model(directory))]
    assert kind == "TikTokenizer"
    return ["--tokenizer-model", str(tiny_tokenizers.tiktoken_vocab(directory)), "--vocab-size", "1266"]


def _model_and_training() -> list[str]:
    """The GPT test model and training flags without their NullTokenizer."""
    flags, kept = iter(TRAINING), []
    for flag in flags:
        if flag in ("--tokenizer-type", "--vocab-size"):
            next(flags)
        else:
            kept.append(flag)
    return GPT_MODEL + kept


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                                  "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer"])
def test_tokenizer_round_trip(tmp_path, kind):
    args = parse_args(_model_and_training() + ["--tokenizer-type", kind] + _flags(kind, tmp_path))
    tokenizer = build_tokenizer(args)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.tokenize(text)
    assert 0 < len(ids) <= len(text) and max(ids) < tokenizer.vocab_size
    assert tokenizer.detokenize(ids).strip() == text
    assert tokenizer.eod is not None


def test_gpt2_bpe_is_the_default_type(tmp_path):
    args = parse_args(_model_and_training() + _flags("GPT2BPETokenizer", tmp_path))
    args.tensor_model_parallel_size = 1
    from megatron.hetero.arguments import validate_args

    validate_args(args)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert build_tokenizer(args).vocab_size == 400


@pytest.mark.parametrize("kind, package", [("GPT2BPETokenizer", "transformers"),
                                           ("HuggingFaceTokenizer", "transformers"),
                                           ("Llama2Tokenizer", "sentencepiece"),
                                           ("TikTokenizer", "tiktoken")])
def test_missing_package_is_named(tmp_path, monkeypatch, kind, package):
    import importlib.util

    args = parse_args(_model_and_training() + ["--tokenizer-type", kind, "--vocab-file", "v",
                                               "--merge-file", "m", "--tokenizer-model", "t"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(HeteroError, match=f"--tokenizer-type {kind} needs the {package} package: "
                                          f"pip install {package}"):
        build_tokenizer(args)


def test_missing_tokenizer_file_is_named(tmp_path):
    args = parse_args(_model_and_training() + ["--tokenizer-type", "Llama2Tokenizer",
                                               "--tokenizer-model", str(tmp_path / "nope.model")])
    with pytest.raises(HeteroError, match="--tokenizer-model .*nope.model: no such file"):
        build_tokenizer(args)


def tokenized_dataset(prefix, tokenizer) -> None:
    """Megatron's .bin/.idx of the sentences, one document each, ended by the tokenizer's eod."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for sentence in tiny_tokenizers.SENTENCES * 4:
        ids = tokenizer.tokenize(sentence) + [tokenizer.eod]
        builder.add_item(torch.tensor(ids, dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.slow
def test_trains_on_text_tokenized_by_a_real_tokenizer(tmp_path):
    flags = ["--tokenizer-type", "Llama2Tokenizer"] + _flags("Llama2Tokenizer", tmp_path / "spm")
    tokenizer = build_tokenizer(parse_args(_model_and_training() + flags))
    tokenized_dataset(tmp_path / "text_document", tokenizer)
    args = [a for a in _model_and_training() if a != "--mock-data"] + flags + [
        "--data-path", str(tmp_path / "text_document"), "--split", "90,8,2", "--train-iters", "3",
        "--eval-iters", "1", "--data-cache-path", str(tmp_path / "cache")]
    result = run_pretrain(args)
    assert result.returncode == 0, result.output[-3000:]
    losses = result.losses()
    # 120 pieces padded to 128: a fresh model starts near ln(128) = 4.85 and learns the text.
    assert len(losses) == 3 and 3.0 < losses[-1] < losses[0] < 6.0
    assert "> building Llama2Tokenizer tokenizer" in result.stdout
