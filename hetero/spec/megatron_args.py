"""A job read from the flags of Megatron-LM's pretrain_gpt.py, without torch or Megatron.

``hetero-plan -- <flags>`` plans from the same command line the run gets, so the plan and the
run describe one model: the flags are parsed with Megatron-LM's own flag table
(megatron_lm_flags.json, next to this file: every flag's name, arity and default at the
pinned tag), Megatron-LM's derived defaults are filled in (ModelSpec), and the vocabulary is
padded as the run pads it: the tokenizer's size rounded up to a multiple of
--make-vocab-size-divisible-by x the plan's tensor-parallel degree (the least common multiple
of the stages' degrees when they differ, as megatron/hetero/arguments/vocabulary.py::padded_vocab_size).
Launch scripts are read by hetero/spec/launch_script.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from hetero.errors import HeteroError
from hetero.pipeline_layout import SplitFlags
from hetero.spec.megatron_tags import facts_file, megatron_tag
from hetero.spec.model import ModelSpec
from hetero.spec.recompute import selective as selective_recompute


# Flags pretrain_gpt.py of Megatron-Hetero adds to Megatron-LM's: option -> number of values.
HETERO_FLAGS = {"--hetero-plan": 1, "--hetero-adapt": 0, "--hetero-adapt-output": 1, "--hetero-snapshot-replicas": 1,
                "--hetero-allow-untested-megatron-core": 0,
                "--local_rank": 1}

_VALUE_TYPES = {"int": int, "float": float}
_NO_VALUE = ("store_true", "store_false", "store_const", "count", "BooleanOptionalAction")


@dataclass(frozen=True)
class _Flag:
    dest: str
    action: str
    nargs: Any
    type: str | None
    choices: tuple | None
    default: Any


@functools.cache
def megatron_flag_table() -> dict[str, _Flag]:
    """Every option string of Megatron-LM's pretrain_gpt.py -> its argparse facts."""
    document = json.loads(facts_file().read_text())  # the installed megatron-core's tag
    table = {}
    for entry in document["flags"]:
        flag = _Flag(entry["dest"], entry["action"], entry["nargs"], entry["type"],
                     tuple(entry["choices"]) if entry["choices"] is not None else None, entry["default"])
        for option in entry["option_strings"]:
            table[option] = flag
    return table


@functools.cache
def megatron_defaults() -> dict[str, Any]:
    """Megatron-LM's default of every flag, by argparse destination (pretrain_gpt.py's)."""
    defaults: dict[str, Any] = {}
    for flag in megatron_flag_table().values():
        defaults.setdefault(flag.dest, flag.default)
    return defaults


@dataclass(frozen=True)
class MegatronFlags:
    """A parsed command line: every destination with its value (Megatron-LM's default where
    the flag is absent), and which destinations the command line set."""

    values: dict[str, Any]
    given: frozenset[str]

    def __getitem__(self, dest: str) -> Any:
        return self.values[dest]

    def given_value(self, dest: str) -> Any:
        """The value the command line gave, None when it left the flag out."""
        return self.values[dest] if dest in self.given else None


def _is_option(token: str) -> bool:
    # argparse's rule for this parser: a token starting with "-" is an option unless it is a
    # negative number (no option of Megatron-LM's looks like one).
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


def _convert(option: str, flag: _Flag, text: str) -> Any:
    kind = _VALUE_TYPES.get(flag.type or "")
    if kind is None:
        value: Any = text
    else:
        try:
            value = kind(text)
        except ValueError:
            raise HeteroError(f"{option} {text!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if flag.choices is not None and value not in flag.choices and str(value) not in map(str, flag.choices):
        raise HeteroError(f"{option} {text!r}: Megatron-LM takes one of {', '.join(map(str, flag.choices))}")
    return value


def _unknown_message(option: str) -> str:
    close = difflib.get_close_matches(option, [*megatron_flag_table(), *HETERO_FLAGS], n=1, cutoff=0.8)
    return f"{option} (did you mean {close[0]}?)" if close else option


def parse_megatron_flags(argv: Sequence[str]) -> MegatronFlags:
    """Parses pretrain_gpt.py's flags as Megatron-LM's parser does (no abbreviations,
    ``--flag=value`` accepted, each flag's arity from the table). Every flag that is not
    Megatron-LM's (or Megatron-Hetero's) and every stray value is named in one error."""
    table = megatron_flag_table()
    values = dict(megatron_defaults())
    given: set[str] = set()
    unknown: list[str] = []
    stray: list[str] = []
    tokens = list(argv)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not _is_option(token):
            stray.append(token)
            continue
        option, has_inline, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        if option in HETERO_FLAGS:  # the run's own flags: no part of the model
            if HETERO_FLAGS[option] and not has_inline:
                index += HETERO_FLAGS[option]
            continue
        flag = table.get(option)
        if flag is None:
            unknown.append(_unknown_message(option))
            continue
        if flag.action in _NO_VALUE:
            if has_inline:
                raise HeteroError(f"{token}: {option} takes no value")
            if flag.action == "BooleanOptionalAction":
                value: Any = not option.startswith("--no-")
            elif flag.action == "count":
                value = (values[flag.dest] or 0) + 1
            else:
                value = {"store_true": True, "store_false": False}.get(flag.action, True)
            values[flag.dest] = value
            given.add(flag.dest)
            continue
        if has_inline:
            texts = [inline]
        else:
            texts = []
            wanted = flag.nargs
            while index < len(tokens) and not _is_option(tokens[index]):
                if wanted is None and texts or isinstance(wanted, int) and len(texts) == wanted:
                    break
                texts.append(tokens[index])
                index += 1
            needed = 1 if wanted in (None, "+") else (wanted if isinstance(wanted, int) else 0)
            if len(texts) < needed:
                count = "a value" if needed == 1 else f"{needed} values"
                raise HeteroError(f"{option} needs {count} (Megatron-LM's pretrain_gpt.py)")
        converted = [_convert(option, flag, text) for text in texts]
        value = converted if flag.nargs is not None else converted[0]
        if flag.action == "append":
            value = [*(values[flag.dest] if flag.dest in given else []), value]
        values[flag.dest] = value
        given.add(flag.dest)
    if unknown or stray:
        parts = []
        if unknown:
            parts.append(f"not flags of Megatron-LM's pretrain_gpt.py: {', '.join(unknown)}")
        if stray:
            parts.append(f"values that follow no flag: {' '.join(stray)}")
        raise HeteroError("; ".join(parts) + ". Correct or remove them (docs/flags.md lists every flag)")
    return MegatronFlags(values, frozenset(given))


# ----- the model -------------------------------------------------------------------------

_REQUIRED_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def model_of_flags(flags: MegatronFlags, vocab_size: int = 0) -> ModelSpec:
    """The model pretrain_gpt.py builds from these flags, Megatron-LM's derived defaults
    filled in (validate_args: FFN width, KV channels, query groups, positions), with this
    (padded) vocabulary."""
    missing = [f"--{name.replace('_', '-')}" for name in _REQUIRED_MODEL_FLAGS if flags[name] is None]
    if missing:
        raise HeteroError(f"the flags do not say the model's {', '.join(missing)}; add them to the launch flags")
    values = dict(flags.values)
    if values["num_experts"] == 0:  # Megatron-LM: 0 experts is a dense model
        values["num_experts"] = None
    if values["kv_channels"] is None and values["hidden_size"] % values["num_attention_heads"]:
        raise HeteroError(f"--hidden-size {values['hidden_size']} is not divisible by --num-attention-heads "
                          f"{values['num_attention_heads']}; set --kv-channels")
    heads, groups = values["num_attention_heads"], values["num_query_groups"]
    if values["group_query_attention"] and (not groups or heads % groups):
        raise HeteroError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    values["padded_vocab_size"] = vocab_size
    return ModelSpec.from_megatron_args(values)


# ----- the vocabulary --------------------------------------------------------------------

# The tokenizers whose size hetero-plan reads without loading a tokenizer library.
COUNTED_TOKENIZERS = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
GPT2_END_OF_DOCUMENT = "<|endoftext|>"


def tokenizer_vocab_size(flags: MegatronFlags, stated: int | None = None) -> int:
    """The size the run's tokenizer reports, before padding (Megatron-LM's tokenizers):

    - NullTokenizer: --vocab-size ids, plus its end-of-document id under core_v0.16.1
      (null_tokenizer_ids);
    - GPT2BPETokenizer: the entries of --vocab-file (<|endoftext|> is one of them in
      GPT-2's file; a file without it gets it added as a special token);
    - HuggingFaceTokenizer: len() of the tokenizer --tokenizer-model names, read with the
      transformers package (when it is installed).

    Other types need ``stated``: the size their tokenizer reports (hetero-plan
    --tokenizer-vocab-size)."""
    kind = flags["tokenizer_type"]
    if stated is not None:
        return stated
    if kind == "NullTokenizer":
        if flags["vocab_size"] is None:
            raise HeteroError("--tokenizer-type NullTokenizer needs --vocab-size")
        return null_tokenizer_ids(flags["vocab_size"])[0]
    if kind == "GPT2BPETokenizer":
        return _gpt2_vocab_size(flags["vocab_file"])
    if kind == "HuggingFaceTokenizer":
        return _huggingface_vocab_size(flags["tokenizer_model"])
    raise HeteroError(
        f"hetero-plan cannot count the vocabulary of --tokenizer-type {kind} without loading it "
        f"(it reads {', '.join(COUNTED_TOKENIZERS)}); give the size the tokenizer reports with "
        "hetero-plan --tokenizer-vocab-size N (Megatron-LM pads it as the run does)")


def null_tokenizer_ids(vocab_size: int, eod_id: int | None = None, tag: str | None = None) -> tuple[int, int]:
    """(vocabulary size, end-of-document id) of Megatron-LM's NullTokenizer for --vocab-size
    under ``tag`` (default: the installed megatron-core's). core_v0.16.1's adds the end of
    document as one more id (vocab_size + 1 ids, eod vocab_size); from core_v0.19.0 on
    (megatron-core's NullTokenizer) the vocabulary is vocab_size ids and the end of document
    its last, or --null-tokenizer-eod-id."""
    if (tag or megatron_tag()) == "core_v0.16.1":
        return vocab_size + 1, vocab_size
    return vocab_size, vocab_size - 1 if eod_id is None else eod_id


def _gpt2_vocab_size(path: str | None) -> int:
    if path is None:
        raise HeteroError("--tokenizer-type GPT2BPETokenizer (Megatron-LM's default) needs --vocab-file "
                          "(or give --tokenizer-type NullTokenizer --vocab-size N)")
    try:
        entries = json.loads(Path(path).read_text())
    except OSError as err:
        raise HeteroError(f"--vocab-file {path}: {err.strerror or err}") from None
    except ValueError:
        raise HeteroError(f"--vocab-file {path}: not a JSON vocabulary (GPT-2's vocab.json)") from None
    if not isinstance(entries, dict):
        raise HeteroError(f"--vocab-file {path}: expected a JSON object of token -> id (GPT-2's vocab.json)")
    return len(entries) + (GPT2_END_OF_DOCUMENT not in entries)


def _huggingface_vocab_size(name: str | None) -> int:
    if name is None:
        raise HeteroError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    try:
        import transformers  # optional: only this tokenizer type needs it
    except ImportError:
        raise HeteroError(
            "--tokenizer-type HuggingFaceTokenizer: hetero-plan reads its size with the transformers "
            "package, which is not installed; pip install transformers, or give the size with "
            "hetero-plan --tokenizer-vocab-size N") from None
    try:
        return len(transformers.AutoTokenizer.from_pretrained(name, use_fast=True))
    except (OSError, ValueError) as err:
        raise HeteroError(f"--tokenizer-model {name}: could not load it ({err})") from None


_USUAL_DIVISORS = (128, 64, 256, 32, 512, 16, 8, 1024, 4, 2, 1)
"""Megatron-LM's usual --make-vocab-size-divisible-by values, tried in this order."""


@dataclass(frozen=True)
class VocabularyPadding:
    """How the run pads its tokenizer's vocabulary: Megatron-LM's rule, up to a multiple of
    divisible_by (--make-vocab-size-divisible-by) x TP; with a degree per stage (or template),
    x their least common multiple (the runtime's rule, so every stage shards it)."""

    tokenizer_vocab_size: int
    divisible_by: int

    def padded(self, degrees: Iterable[int], divisible_by: int | None = None) -> int:
        multiple = (divisible_by or self.divisible_by) * math.lcm(*degrees)
        return -(-self.tokenizer_vocab_size // multiple) * multiple

    def divisor_giving(self, padded: int, degrees: Iterable[int]) -> int | None:
        """The --make-vocab-size-divisible-by that pads to ``padded`` at these degrees (this
        job's own first, then Megatron-LM's usual ones), or None."""
        degrees = tuple(degrees)
        for divisor in (self.divisible_by, *_USUAL_DIVISORS):
            if self.padded(degrees, divisor) == padded:
                return divisor
        return None

    def is_padding(self, vocab_size: int, max_tensor_parallel: int = 256) -> bool:
        """Whether vocab_size is this tokenizer's vocabulary padded for some degree (as a
        profile taken from the same flags at other degrees records it)."""
        return any(self.padded((t,)) == vocab_size for t in range(1, max_tensor_parallel + 1))



# ----- the job ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FlagsJob:
    """What hetero-plan takes from pretrain_gpt.py's flags. Layout flags (TP, PP, micro-batch,
    global batch) are None where the flags leave them to the plan."""

    flags: MegatronFlags
    model: ModelSpec
    """vocab_size: the tokenizer's, unpadded (``vocabulary`` pads it for a layout)."""
    tokenizer_vocab: int
    global_batch_size: int | None
    micro_batch_size: int | None
    tensor_parallel: int | None
    pipeline_parallel: int | None
    precision: str
    recompute: str | None
    """None: the flags ask for none, so the plan may choose per stage."""
    sequence_parallel: bool | None
    """True: the flags ask for it; None: the plan's choice (the run follows the plan)."""
    virtual_stages: int | None
    expert_parallel: int | None
    """--expert-model-parallel-size where the flags give it (None: the plan's choice)."""
    expert_tensor_parallel: int | None
    """--expert-tensor-parallel-size where the flags give it (None: the plan's choice)."""
    distributed_optimizer: bool
    fused_kernels: bool
    dropout: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grad_reduce_dtype: str | None

    @property
    def vocabulary(self) -> VocabularyPadding:
        return VocabularyPadding(self.tokenizer_vocab, self.flags["make_vocab_size_divisible_by"])

    def model_for(self, tensor_parallel_sizes: Iterable[int]) -> ModelSpec:
        """The model as the run builds it at these tensor-parallel degrees (its padding)."""
        return dataclasses.replace(self.model, vocab_size=self.vocabulary.padded(tuple(tensor_parallel_sizes)))


def job_of_flags(argv: Sequence[str], tokenizer_vocab: int | None = None) -> FlagsJob:
    """Parses pretrain_gpt.py's flags into the model and the training set-up they describe."""
    flags = parse_megatron_flags(argv)
    model = model_of_flags(flags)  # first: a missing model flag is the first thing to say
    vocab = tokenizer_vocab_size(flags, tokenizer_vocab)
    model = dataclasses.replace(model, vocab_size=vocab)
    split = SplitFlags(flags["decoder_first_pipeline_num_layers"], flags["decoder_last_pipeline_num_layers"],
                       flags["pipeline_model_parallel_layout"],
                       bool(flags["account_for_embedding_in_pipeline_split"]),
                       bool(flags["account_for_loss_in_pipeline_split"]))
    if split.shapes_stages:  # the run would hold the plan to them: the plan could not differ
        raise HeteroError(f"{', '.join(split.given())}: the plan decides how the layers split over the "
                          "stages (stages[s].num_layers); remove these flags to plan from the script, "
                          "or keep them and run without --hetero-plan (Megatron-LM's own split)")
    recompute = flags["recompute_granularity"]
    if flags["recompute_activations"]:  # Megatron-LM's alias of selective
        recompute = "selective"
    if recompute == "selective":  # megatron-core's modules (default: the attention core)
        recompute = selective_recompute(flags["recompute_modules"] or None)
    virtual = flags["num_virtual_stages_per_pipeline_rank"]
    if flags["num_layers_per_virtual_pipeline_stage"]:
        pipeline = flags.given_value("pipeline_model_parallel_size")
        if not pipeline:
            raise HeteroError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size "
                              "(or give --num-virtual-stages-per-pipeline-rank)")
        virtual = model.num_layers // (pipeline * flags["num_layers_per_virtual_pipeline_stage"])
    dropout = bool(flags["hidden_dropout"]) or bool(flags["attention_dropout"])
    return FlagsJob(
        flags=flags, model=model, tokenizer_vocab=vocab,
        global_batch_size=flags.given_value("global_batch_size"),
        micro_batch_size=flags.given_value("micro_batch_size"),
        tensor_parallel=flags.given_value("tensor_model_parallel_size"),
        pipeline_parallel=flags.given_value("pipeline_model_parallel_size"),
        precision="bf16" if flags["bf16"] else ("fp16" if flags["fp16"] else "fp32"),
        recompute=recompute, sequence_parallel=True if flags["sequence_parallel"] else None,
        virtual_stages=virtual, expert_parallel=flags.given_value("expert_model_parallel_size"),
        expert_tensor_parallel=flags.given_value("expert_tensor_parallel_size"),
        distributed_optimizer=bool(flags["use_distributed_optimizer"]),
        fused_kernels=flags["transformer_impl"] != "local" and flags["attention_backend"] not in ("local", "unfused"),
        dropout=dropout, overlap_grad_reduce=bool(flags["overlap_grad_reduce"]),
        overlap_param_gather=bool(flags["overlap_param_gather"]),
        grad_reduce_dtype="bf16" if flags["grad_reduce_in_bf16"] else None,
    )

