"""Malformed plan files get a named error, never a traceback.

Variants are generated from a real plan written by hetero-plan: for the fields of every
section of the job record and of the layout, each field deleted, negative, a string, an
empty string/list/dict, huge (10**12, 10**30) and null. Every variant must be refused by
Plan.load with a PlanError that names the field, and by ``hetero-plan explain`` with exit
code 2 and ``error:``; a sample of them also by pretrain_gpt.py. A sweep over every field of
two plans (each mutation, the accepted ones included) checks that nothing ends in a
traceback.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from conftest import GPT_MODEL, REPO, TRAINING, run_pretrain
from hetero.cli import main
from hetero.errors import HeteroError, PlanError
from hetero.plan import Plan
from hetero.predict.training_setup import TrainingSetup
from hetero.record import MAX_COUNT, ModelRecord, TrainingRecord
from hetero.spec.model import ModelSpec

CLUSTERS = REPO / "examples" / "clusters"

MUTATIONS = {
    "negative": -1,
    "string": "many",
    "empty string": "",
    "empty list": [],
    "empty dict": {},
    "huge": 10**12,
    "huger": 10**30,
    "null": None,
}
ALL = frozenset(MUTATIONS) | {"delete"}
OPTIONAL = ALL - {"delete", "null"}  # a field that may be left out or null
DEFAULTED = ALL - {"delete"}  # a field that may be left out, not null
TEXT = frozenset({"negative", "empty list", "empty dict", "huge", "huger"})  # free text: only non-strings

# What each field refuses ("delete" and "null" are fine where a field is optional, a
# string where it is free text). Paths are dotted; a number indexes a list.
REFUSED: dict[str, frozenset[str]] = {
    # the layout
    "version": ALL, "tensor_parallel": ALL, "pipeline_parallel": ALL, "data_parallel": ALL,
    "micro_batch_size": ALL, "stages": ALL, "replicas": ALL, "rank_order": ALL, "devices": ALL,
    "stages.0.num_layers": ALL, "replicas.0.num_micro_batches": ALL, "rank_order.0": ALL,
    "devices.0.host": ALL, "devices.0.device_type": ALL, "devices.0.vendor": ALL - {"string"},
    # model
    **{f"model.{name}": ALL for name in ("num_layers", "hidden_size", "num_attention_heads",
                                         "seq_length", "vocab_size")},
    **{f"model.{name}": OPTIONAL for name in ("ffn_hidden_size", "num_query_groups", "kv_channels",
                                              "max_position_embeddings")},
    **{f"model.{name}": DEFAULTED for name in ("swiglu", "untie_embeddings_and_output_weights",
                                               "add_bias_linear", "normalization", "position_embedding_type",
                                               "moe_router_topk")},
    # training
    "training.global_batch_size": ALL, "training.seq_length": ALL, "training.precision": ALL,
    **{f"training.{name}": DEFAULTED for name in ("distributed_optimizer", "fused_kernels", "dropout",
                                                  "recompute", "sequence_parallel", "virtual_stages",
                                                  "overlap_grad_reduce", "overlap_param_gather",
                                                  "scatter_stage_transfers", "tp_comm_overlap")},
    "training.grad_reduce_dtype": OPTIONAL, "training.fused_softmax": OPTIONAL, "training.precision_reason": TEXT,
    # cluster (hetero.spec.cluster's own bounds: no upper one on bandwidths)
    "cluster.name": ALL - {"string", "empty string"},
    "cluster.groups": ALL, "cluster.groups.0.nodes": ALL, "cluster.groups.0.nodes.0.count": ALL,
    "cluster.groups.0.nodes.0.device": ALL, "cluster.groups.0.nodes.0.intra_link": ALL,
    "cluster.groups.0.nodes.0.nic.gbps": ALL - {"huge", "huger"},
    "cluster.devices.cpu-fast.memory_gib": ALL - {"huge", "huger"},
    # prediction
    "prediction.iteration_time_s": ALL, "prediction.tokens_per_s": ALL,
    **{f"prediction.{name}": OPTIONAL for name in ("pipeline_s", "optimizer_s")},
    "prediction.fits_in_memory": OPTIONAL, "prediction.gradient_reduction_s": OPTIONAL - {"empty list"},
    "prediction.peak_memory_gib": OPTIONAL - {"empty dict"}, "prediction.peak_memory_gib.cpu-fast": DEFAULTED,
    "prediction.fraction_of_upper_bound": ALL, "prediction.speedup_over_baseline": ALL,
    "prediction.upper_bound.tokens_per_s": ALL,
    **{f"prediction.baseline.{name}": ALL for name in ("tensor_parallel", "pipeline_parallel", "data_parallel",
                                                       "micro_batch_size", "recompute", "iteration_time_s",
                                                       "tokens_per_s")},
    # provenance
    "provenance.tool": ALL - {"string"}, "provenance.created": ALL,
    **{f"provenance.{name}": OPTIONAL for name in ("search_time_s", "total_time_s", "candidates_estimated")},
    "provenance.family": TEXT, "provenance.profiles": TEXT,
}
# The mutations that are not field edits: sizes far from the lists', a wrong version.
SPECIAL = {
    "version 4": ("version", 4),
    "version '3'": ("version", "3"),
    "version true": ("version", True),
    "rank_order of 10**5 entries": ("rank_order", list(range(10**5))),
    "rank_order with 10**30": ("rank_order.0", 10**30),
    "stages of another count": ("stages", [{"num_layers": 3}, {"num_layers": 3}]),
    "data_parallel 10**6 (under the bound, not the replicas' count)": ("data_parallel", 10**6),
    "tensor_parallel 2.0": ("tensor_parallel", 2.0),
    "a node of 10**12 devices": ("cluster.groups.0.nodes.0.count", 10**12),
    "10**12 nodes": ("cluster.groups.0.nodes.0", {"host_prefix": "n", "num_nodes": 10**12, "device": "cpu-fast",
                                                   "count": 2, "intra_link": "loopback",
                                                   "nic": {"kind": "ethernet", "gbps": 8}}),
    "a host the cluster lacks": ("devices.0.host", "elsewhere"),
    "model unknown key": ("model.num_layer", 6),
    "training unknown key": ("training.sequence_paralel", True),
    "created not a time": ("provenance.created", "yesterday"),
    "heads not dividing hidden": ("model.num_attention_heads", 7),
    "an infinite time": ("prediction.iteration_time_s", float("inf")),
}


def _write_plan(tmp_path_factory, name: str, *args: str) -> dict:
    out = tmp_path_factory.mktemp(name) / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*args, "--quiet", "-o", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def demo_plan(tmp_path_factory) -> dict:
    """The CPU demo's plan: every section, with the baseline and the upper bound."""
    return _write_plan(tmp_path_factory, "demo", "--cluster", str(CLUSTERS / "cpu_demo.yaml"), "--model",
                       str(REPO / "examples/models/llama_tiny.yaml"), "--global-batch-size", "16",
                       "--seq-length", "128", "--micro-batch-size", "2", "--tensor-parallel", "1,2",
                       "--precision", "fp32", "--no-fused-kernels", "--no-dropout")


@pytest.fixture(scope="module")
def pipelined_plan(tmp_path_factory) -> dict:
    """A plan with pipeline and tensor parallelism on 64 devices of three kinds."""
    return _write_plan(tmp_path_factory, "holmes", "--cluster", str(CLUSTERS / "holmes_like.yaml"), "--model",
                       "llama2-7b", "--global-batch-size", "512", "--seq-length", "4096", "--skip-upper-bound")


def _mutated(data: dict, path: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    parent = data
    for key in parents:
        parent = parent[key]
    if value == "delete":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(value)
    return data


def _variants() -> list[tuple[str, str, object]]:
    """(id, path, new value or "delete") of every malformed variant."""
    out = [(f"{path} {kind}", path, "delete" if kind == "delete" else MUTATIONS[kind])
           for path, kinds in REFUSED.items() for kind in sorted(kinds)]
    return out + [(name, path, value) for name, (path, value) in SPECIAL.items()]


VARIANTS = _variants()
# Each kind of edit once, through a real hetero-plan process (each start costs most of a second).
SAMPLE = [v for v in VARIANTS if v[0] in (
    "data_parallel huge", "stages empty list", "devices null", "rank_order.0 delete", "model.hidden_size string",
    "model.vocab_size empty dict", "training.precision null", "prediction.tokens_per_s negative",
    "provenance.created empty string", "cluster.groups.0.nodes.0.count huger", "version 4",
    "rank_order of 10**5 entries", "10**12 nodes", "tensor_parallel 2.0")]


def _explain_in_process(path: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["explain", str(path)])  # anything but HeteroError propagates: a traceback
    return code, err.getvalue()


def _named(message: str, path: str) -> bool:
    """The message names the field: its section (or top-level name) and its own name."""
    parts = [p for p in path.split(".") if not p.isdigit()]
    return all(part in message for part in (parts[0], parts[-1]))


@pytest.mark.parametrize("name, path, value", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_malformed_plan_is_refused_naming_the_field(demo_plan, tmp_path, name, path, value):
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(_mutated(demo_plan, path, value)))
    with pytest.raises(PlanError) as refused:
        Plan.load(file)
    assert isinstance(refused.value, HeteroError)
    message = str(refused.value)
    assert _named(message, path), message
    assert "Traceback" not in message and len(message) < 3000, message
    code, stderr = _explain_in_process(file)
    assert code == 2 and stderr.startswith("error: ") and "Traceback" not in stderr, stderr


def _explain_process(file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero", "explain", str(file)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, path, value", SAMPLE, ids=[v[0] for v in SAMPLE])
def test_hetero_plan_explain_exits_2_on_a_malformed_plan(demo_plan, tmp_path, name, path, value):
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(_mutated(demo_plan, path, value)))
    result = _explain_process(file)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr + result.stdout
    assert _named(result.stderr, path), result.stderr


def _every_edit(data, path: str = ""):
    """Every field of the plan (the first entry of each list) and each mutation of it."""
    items = data.items() if isinstance(data, dict) else list(enumerate(data))[:1]
    for key, value in items:
        here = f"{path}.{key}" if path else str(key)
        yield here, "delete"
        for mutation in MUTATIONS.values():
            yield here, mutation
        if isinstance(value, (dict, list)):
            yield from _every_edit(value, here)


@pytest.mark.parametrize("which", ["demo_plan", "pipelined_plan"])
def test_no_edit_of_any_field_ends_in_a_traceback(which, request, tmp_path):
    """Accepted or refused, every edit ends in a plan or a named error: Plan.load raises
    nothing but PlanError, and explain exits 0, or 2 with "error:"."""
    plan = request.getfixturevalue(which)
    file = tmp_path / "plan.json"
    edits = 0
    for path, value in _every_edit(plan):
        file.write_text(json.dumps(_mutated(plan, path, value)))
        edits += 1
        try:
            Plan.load(file)
        except PlanError:
            continue
        code, stderr = _explain_in_process(file)
        assert code == 0 or (code == 2 and stderr.startswith("error: ")), (path, value, stderr)
    assert edits > 500


def test_sizes_are_compared_before_anything_is_built(demo_plan):
    """The largest degrees the bounds allow, with four replicas listed: refused by counting
    (a world of 2**60 ranks), never by building range(world)."""
    data = {**demo_plan, "data_parallel": MAX_COUNT, "tensor_parallel": MAX_COUNT, "pipeline_parallel": MAX_COUNT}
    tracemalloc.start()
    try:
        with pytest.raises(PlanError, match="replicas has 4 entries but data_parallel is 1048576"):
            Plan.from_dict(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000


def test_unreadable_files_get_named_errors(tmp_path):
    for content, fragment in [(b"", "is not valid JSON"), (b"\xff\xfe\x00", "cannot be read as text"),
                              (b"[" * 100_000, "cannot be read as a plan"), (b"[]", "a plan is a JSON object"),
                              (b"1" * 5000, "cannot be read as a plan")]:
        file = tmp_path / "plan.json"
        file.write_bytes(content)
        with pytest.raises(PlanError, match=fragment):
            Plan.load(file)
    with pytest.raises(PlanError, match="cannot be read as text"):
        Plan.load(tmp_path)  # a directory


def test_the_record_mirrors_the_specs_it_records():
    """A field added to ModelSpec or TrainingSetup must be added to the record too."""
    assert list(ModelRecord.model_fields) == [f.name for f in dataclasses.fields(ModelSpec)]
    setup = [name for name in TrainingRecord.model_fields if name not in TrainingRecord.JOB_FIELDS]
    assert setup == [f.name for f in dataclasses.fields(TrainingSetup)]
    assert TrainingSetup(**TrainingRecord(global_batch_size=8, seq_length=64, precision="fp16").setup_fields()) \
        == TrainingSetup(precision="fp16")


# ----- the runtime ------------------------------------------------------------------------

RUNTIME = ["data_parallel huge", "model.hidden_size string", "training.precision null",
           "prediction.tokens_per_s negative"]


@pytest.mark.parametrize("name", RUNTIME)
def test_pretrain_refuses_a_malformed_plan_with_our_error(demo_plan, tmp_path, name):
    _, path, value = next(v for v in VARIANTS if v[0] == name)
    result = run_pretrain(GPT_MODEL + TRAINING, plan=_mutated(demo_plan, path, value), tmp_path=tmp_path,
                          timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "[launch rank 0] error: " in result.stderr and "is not a valid hetero plan" in result.stderr
    assert _named(result.stderr, path), result.stderr[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
