"""The flags of a later Megatron-LM tag than the reference one (core_v0.19.0, with megatron-core
0.19.2 installed): each flag it added has a ruling of its own, and the renamed and new flags
the runtime honours reach megatron-core. Run by make test's core019 pass (PYTHONPATH=.core019);
skipped on megatron-core 0.16.1."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import GPT_MODEL, TRAINING
from megatron.hetero import flags
from megatron.hetero.arguments import build_parser, parse_args

BASE = GPT_MODEL + TRAINING

CORE019 = "core_v0.19.0"
TABLE = flags.rulings(flags.defined_options(build_parser()))
pytestmark = [
    pytest.mark.core019,
    pytest.mark.skipif(flags.megatron_tag() != CORE019, reason="core_v0.19.0's flags: megatron-core 0.19.2 "
                       "(make test's core019 pass, PYTHONPATH=.core019)"),
]


def test_core_v0_19_0_tokenizer_flags_reach_megatron_cores_tokenizer(tmp_path, monkeypatch):
    """core_v0.19.0 turned --tokenizer-hf-use-fast and --tokenizer-hf-include-special-tokens into
    their negations (both on unless negated) and added --chat-template and a SentencePiece
    whitespace switch: honoured, read by the old dests too (flags/later_tags.py) and passed to
    megatron-core's tokenizer as its build_tokenizer passes them."""
    import tiny_tokenizers
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.hetero.data import build_tokenizer

    renamed = ["--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens"]
    for name in (*renamed, "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--chat-template"):
        assert TABLE[name].status is flags.Status.HONOURED, name
    default, given = parse_args(BASE), parse_args(BASE + renamed)
    assert (default.tokenizer_hf_use_fast, default.tokenizer_hf_include_special_tokens) == (True, True)
    assert (given.tokenizer_hf_use_fast, given.tokenizer_hf_include_special_tokens) == (False, False)
    assert given.noop_flags == []

    built = []
    from_pretrained = MegatronTokenizer.from_pretrained
    monkeypatch.setattr(MegatronTokenizer, "from_pretrained",
                        lambda *a, **k: built.append(k) or from_pretrained(*a, **k))
    vocab, merges = tiny_tokenizers.gpt2_bpe_files(tmp_path / "gpt2")
    for model in (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                   str(tiny_tokenizers.huggingface_dir(tmp_path / "hf"))],
                  ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                   "--merge-file", str(merges)]):
        plain = build_tokenizer(parse_args(BASE + model))
        negated = build_tokenizer(parse_args(BASE + model + renamed))
        assert (built[0]["use_fast"], built[1]["use_fast"]) == (True, False), model
        included = plain._tokenizer.include_special_tokens, negated._tokenizer.include_special_tokens
        assert included == (True, False), model
        built.clear()
    model = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "hf")]
    template = build_tokenizer(parse_args(BASE + model + ["--chat-template", "{{ messages }}"]))
    assert template._tokenizer.chat_template == "{{ messages }}"
    model = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             str(tiny_tokenizers.sentencepiece_model(tmp_path / "spm"))]
    built.clear()
    for given in ([], ["--no-tokenizer-sentencepiece-ignore-extra-whitespaces"]):
        build_tokenizer(parse_args(BASE + model + given))
    assert [k["ignore_extra_whitespaces"] for k in built] == [True, False]


def test_core_v0_19_0_rulings_of_the_flags_it_added():
    """Every flag core_v0.19.0 added has a ruling of its own (none left "unreviewed"), and a
    config field of it that megatron-core's training reads reaches TransformerConfig."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.hetero.arguments import honoured_config_values

    added = set(TABLE) - {f.name for f in flags.megatron_flags("core_v0.16.1")}
    assert [name for name in added if TABLE[name].theme == "unreviewed"] == []
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert honoured_config_values(parse_args(BASE + ["--mlp-chunks-for-training", "2"]), fields)[
        "mlp_chunks_for_training"] == 2
    assert TABLE["--yarn-beta-fast"].status is flags.Status.NOOP
    assert "--moe-paged-stash" in TABLE["--moe-paged-stash-page-size"].reason
    assert TABLE["--async-strategy"].theme == "checkpoint_options"


def test_the_null_tokenizer_counts_the_vocabulary_as_the_installed_release_does():
    """core_v0.19.0's NullTokenizer (megatron-core's) keeps --vocab-size ids, the end of document
    the last or --null-tokenizer-eod-id, padding --null-tokenizer-pad-id; core_v0.16.1's adds the
    end of document as one id more. The planner counts it as the runtime builds it, and the
    tokenizer agrees with megatron-core's own."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as CoreNullTokenizer
    from megatron.hetero.data import build_tokenizer
    from hetero.spec.megatron_args import null_tokenizer_ids, parse_megatron_flags, tokenizer_vocab_size

    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    for name in ("--null-tokenizer-eod-id", "--null-tokenizer-pad-id"):
        assert TABLE[name].status is flags.Status.HONOURED, name
    ours, core = build_tokenizer(parse_args(BASE + null)), CoreNullTokenizer(1000)
    assert (ours.vocab_size, ours.eod, ours.pad) == (core.vocab_size, core.eod, core.pad_id) == (1000, 999, -1)
    given = build_tokenizer(parse_args(BASE + null + ["--null-tokenizer-eod-id", "0", "--null-tokenizer-pad-id", "5"]))
    assert (given.vocab_size, given.eod, given.pad) == (1000, 0, 5)
    assert tokenizer_vocab_size(parse_megatron_flags(null)) == 1000
    assert null_tokenizer_ids(1000, tag="core_v0.16.1") == (1001, 1000)
