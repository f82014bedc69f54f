"""Tiny tokenizer files of every kind Megatron-LM recipes name, built from a few sentences
with the tokenizers' own packages (tokenizers, sentencepiece) or written out (tiktoken)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a heterogeneous cluster mixes accelerators and network cards",
    "megatron trains large language models with tensor and pipeline parallelism",
    "every replica runs its own number of micro batches",
    "the loss is averaged over the tokens of the global batch",
    "pipeline stages may hold different numbers of layers",
    "checkpoints are written atomically and resharded on load",
    "the learning rate warms up and then decays along a cosine",
] * 8


def gpt2_bpe_files(directory: Path) -> tuple[Path, Path]:
    """A byte-level BPE vocab.json / merges.txt pair (GPT2BPETokenizer's files)."""
    from tokenizers import ByteLevelBPETokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(SENTENCES, vocab_size=400, min_frequency=1,
                                  special_tokens=["<|endoftext|>"])
    tokenizer.save_model(str(directory))
    return directory / "vocab.json", directory / "merges.txt"


def huggingface_dir(directory: Path) -> Path:
    """A directory AutoTokenizer loads: tokenizer.json (trained BPE) and its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(SENTENCES, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>"}))
    return directory


def sentencepiece_model(directory: Path) -> Path:
    """A SentencePiece model (SentencePieceTokenizer / Llama2Tokenizer's file)."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / "spm"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES), model_prefix=str(prefix), vocab_size=120,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    return Path(f"{prefix}.model")


def tiktoken_vocab(directory: Path) -> Path:
    """A tiktoken BPE vocabulary in megatron-core's JSON form: the 256 bytes, then merges."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([i]) for i in range(256)]
    for merged in (b"th", b"he", b"the", b"in", b"er", b" t", b" the", b"an", b"on", b"re"):
        tokens.append(merged)
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
             for i, t in enumerate(tokens)]
    path = directory / "tiktoken.json"
    path.write_text(json.dumps(vocab))
    return path


def files_for(kind: str, directory: Path) -> dict[str, str]:
    """The file flags a --tokenizer-type reads (--vocab-file/--merge-file or --tokenizer-model),
    pointing at tiny files of that type made under directory; {} for a type that reads none."""
    if kind == "GPT2BPETokenizer":
        vocab, merges = gpt2_bpe_files(directory / "gpt2")
        return {"--vocab-file": str(vocab), "--merge-file": str(merges)}
    if kind == "HuggingFaceTokenizer":
        return {"--tokenizer-model": str(huggingface_dir(directory / "hf"))}
    if kind == "TikTokenizer":
        return {"--tokenizer-model": str(tiktoken_vocab(directory / "tik"))}
    if kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"):
        return {"--tokenizer-model": str(sentencepiece_model(directory / "spm"))}
    return {}
