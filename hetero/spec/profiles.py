"""Measured profiles that replace the predictor's analytical estimates.

A profile directory holds JSON files of two kinds (tools/ writes them):

compute - one device type, one model shape, timings per (tensor parallel, micro-batch):

    {"kind": "compute", "device_type": "A100-40GB", "precision": "bf16",
     "model": {"hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 32,
               "ffn_hidden_size": 11008, "seq_length": 4096, "swiglu": true, "vocab_size": 32000},
     "entries": [{"tensor_parallel": 1, "micro_batch_size": 1,
                  "layer_forward_s": 0.0071, "layer_backward_s": 0.0139,
                  "layer_activation_bytes": 1.1e9,                      # optional
                  "logits_forward_s": 0.004, "logits_backward_s": 0.008,    # optional
                  "batch_s": 0.0002,                                        # optional
                  "embedding_forward_s": 0.0003, "embedding_backward_s": 0.0006}],  # optional
     "optimizer_step_s_per_param": 2.1e-11, "optimizer_step_fixed_s": 0.004}  # optional

links - measured point-to-point routes between hosts (a host with itself: inside a node):

    {"kind": "links", "links": [{"hosts": ["a0", "b0"], "bandwidth_gbs": 11.2, "latency_us": 14}],
     "collectives": [{"op": "allreduce", "hosts": ["a0", "a0", "b0"], "bytes": 6.7e7, "seconds": 0.31}]}

"logits" is all of a one-stage model that is not a decoder layer (the batch, embedding,
output layer and loss); the batch and embedding fields are its first stage's part.

A link's bandwidth is what ONE device pair gets while every device of the two hosts
transfers at once (the NIC shared), as cluster.py's routes mean it.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hetero.errors import HeteroError
from hetero.spec.model import ModelSpec
from hetero.io import describe_validation_error

def model_shape(model: ModelSpec) -> dict:
    """The fields a per-layer timing depends on (layer count does not matter)."""
    return {
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.query_groups,
        "ffn_hidden_size": model.ffn,
        "seq_length": model.seq_length,
        "swiglu": model.swiglu,
        "vocab_size": model.vocab_size,
    }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComputeEntry(_Strict):
    tensor_parallel: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    layer_forward_s: float = Field(gt=0)
    layer_backward_s: float = Field(gt=0)
    layer_activation_bytes: float | None = Field(default=None, ge=0)
    logits_forward_s: float | None = Field(default=None, ge=0)
    logits_backward_s: float | None = Field(default=None, ge=0)
    # The first stage's part of "logits" (which is all that is not a decoder layer): reading
    # the batch, and the embedding's forward and backward.
    batch_s: float | None = Field(default=None, ge=0)
    embedding_forward_s: float | None = Field(default=None, ge=0)
    embedding_backward_s: float | None = Field(default=None, ge=0)
    # How much one micro-batch's forward and backward varies from one to the next (standard
    # deviation / mean, on a rank running beside the others): synchronous replicas wait for
    # the slowest (hetero/predict/stragglers.py).
    micro_batch_cv: float | None = Field(default=None, ge=0)


class ComputeProfile(_Strict):
    kind: Literal["compute"]
    device_type: str
    precision: str = "bf16"
    model: dict
    entries: list[ComputeEntry] = Field(min_length=1)
    optimizer_step_s_per_param: float | None = Field(default=None, gt=0)
    """megatron-core's optimizer step (gradients to main, norm, clipping, Adam, weights back)
    per parameter held."""
    optimizer_step_fixed_s: float | None = Field(default=None, ge=0)
    """What a rank pays per iteration beyond that: the step's own work and the small all-
    reduces around it (the token count, the loss, the gradient norm), measured with every
    profiled rank stepping at once."""
    measured_on: str | None = None


def median_entry(entries: list[dict]) -> dict:
    """One entry from several measurements of the same case (ranks of a device type, or
    profiling passes): the median of every timing and size."""
    merged = dict(entries[0])
    for key in merged:
        if key.endswith(("_s", "_bytes", "_cv")):
            values = [e[key] for e in entries if e.get(key) is not None]
            merged[key] = statistics.median(values) if values else None
    return merged


def median_profile(passes: list[ComputeProfile]) -> ComputeProfile:
    """One device type's profile from passes taken at different times. A machine whose
    speed drifts over minutes (a shared virtual machine) puts its drift into any single
    pass; the median of passes spread over a job's runs does not carry one moment's."""
    if len({(p.device_type, p.precision) for p in passes}) != 1:
        raise HeteroError("median_profile: the passes profile different device types or precisions")
    cases: dict[tuple[int, int], list[dict]] = {}
    for profile in passes:
        for entry in profile.entries:
            cases.setdefault((entry.tensor_parallel, entry.micro_batch_size), []).append(entry.model_dump())
    steps = [p.optimizer_step_s_per_param for p in passes if p.optimizer_step_s_per_param is not None]
    fixed = [p.optimizer_step_fixed_s for p in passes if p.optimizer_step_fixed_s is not None]
    return ComputeProfile.model_validate({
        **passes[0].model_dump(),
        "entries": [median_entry(entries) for entries in cases.values()],
        "optimizer_step_s_per_param": statistics.median(steps) if steps else None,
        "optimizer_step_fixed_s": statistics.median(fixed) if fixed else None,
        "measured_on": "median of " + "; ".join(str(p.measured_on) for p in passes)})


class LinkEntry(_Strict):
    hosts: tuple[str, str]
    bandwidth_gbs: float = Field(gt=0)
    latency_us: float = Field(ge=0)


class CollectiveEntry(_Strict):
    """A measured collective over ranks on `hosts` (one entry per member), for reports."""

    op: str
    hosts: list[str]
    bytes: float = Field(ge=0)
    seconds: float = Field(ge=0)


class LinkProfile(_Strict):
    kind: Literal["links"]
    links: list[LinkEntry]
    collectives: list[CollectiveEntry] = []
    measured_on: str | None = None


class Profiles:
    """All profiles of a directory, looked up by device type / host pair."""

    def __init__(self, compute: list[ComputeProfile] = (), links: list[LinkProfile] = ()):
        self.compute = list(compute)
        self.link_profiles = list(links)
        self.links: dict[frozenset, LinkEntry] = {}
        for profile in links:
            for link in profile.links:
                self.links[frozenset(link.hosts)] = link

    @classmethod
    def load_dir(cls, directory: str | os.PathLike) -> "Profiles":
        directory = Path(directory)
        if not directory.is_dir():
            raise HeteroError(f"profile directory {directory} does not exist")
        compute, links = [], []
        for path in sorted(directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise HeteroError(f"profile {path} is not valid JSON: {err}") from None
            kind = data.get("kind") if isinstance(data, dict) else None
            schema = {"compute": ComputeProfile, "links": LinkProfile}.get(kind)
            if schema is None:
                raise HeteroError(f"profile {path}: \"kind\" must be \"compute\" or \"links\", got {kind!r}")
            try:
                (compute if kind == "compute" else links).append(schema.model_validate(data))
            except ValidationError as err:
                raise HeteroError(describe_validation_error(
                    err, str(path), f"{kind} profile", "See hetero/spec/profiles.py for the format.")) from None
        return cls(compute, links)

    def with_compute_passes(self, *later: "Profiles") -> "Profiles":
        """These links, and every device type's compute profile the median of this pass and
        the later ones (median_profile)."""
        passes: dict[tuple, list[ComputeProfile]] = {}
        for profiles in (self, *later):
            for profile in profiles.compute:
                key = (profile.device_type, profile.precision, json.dumps(profile.model, sort_keys=True))
                passes.setdefault(key, []).append(profile)
        return Profiles([median_profile(p) for p in passes.values()], self.link_profiles)

    def compute_profile(self, device_type: str, model: ModelSpec, precision: str) -> ComputeProfile | None:
        shape = model_shape(model)
        for profile in self.compute:
            if (profile.device_type == device_type and profile.precision == precision
                    and all(profile.model.get(k) == v for k, v in shape.items())):
                return profile
        return None

    def missing(self, device_types: list[str], model: ModelSpec, precision: str) -> list[str]:
        return [d for d in device_types if self.compute_profile(d, model, precision) is None]

    @staticmethod
    def entry(profile: ComputeProfile, tensor_parallel: int, micro_batch_size: int) -> tuple[ComputeEntry, float]:
        """The measured entry for (tp, mbs), or the closest one and the factor to scale it by.

        Per-layer time grows about linearly in micro-batch size and shrinks about linearly
        in tensor-parallel size; the closest entry is scaled by that ratio.
        """
        def distance(e: ComputeEntry) -> tuple:
            return (e.tensor_parallel != tensor_parallel, abs(e.micro_batch_size - micro_batch_size))

        best = min(profile.entries, key=distance)
        scale = (micro_batch_size / best.micro_batch_size) * (best.tensor_parallel / tensor_parallel)
        return best, scale

    def link(self, host_a: str, host_b: str) -> LinkEntry | None:
        return self.links.get(frozenset((host_a, host_b)))

    def allreduce_fit(self, hosts: tuple[str, ...]) -> tuple[float, float] | None:
        """(seconds per byte, fixed seconds) of a whole all-reduce over members on exactly
        these hosts, from two or more measured sizes; None when not measured. What the
        library really does (its ring order, duplex use of a NIC) is in the measurement."""
        wanted = sorted(hosts)
        sizes: dict[float, float] = {}
        for profile in self.link_profiles:
            for entry in profile.collectives:
                if entry.op == "allreduce" and sorted(entry.hosts) == wanted:
                    sizes[entry.bytes] = entry.seconds
        if len(sizes) < 2:
            return None
        # least squares through every measured size (one noisy size moves it less)
        mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(sizes.values())
        spread = sum((x - mean_x) ** 2 for x in sizes)
        per_byte = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in sizes.items()) / spread)
        return per_byte, max(0.0, mean_y - per_byte * mean_x)

    def ring_step_s(self) -> float | None:
        """What each step of the library's ring all-reduce costs beyond its bytes on this
        cluster: the fixed term of the all-reduce measured over the most members, spread
        over its ring's 2 (n - 1) steps; None when no all-reduce was measured."""
        measured = {tuple(sorted(e.hosts)) for p in self.link_profiles for e in p.collectives if e.op == "allreduce"}
        for hosts in sorted(measured, key=len, reverse=True):
            fit = self.allreduce_fit(hosts)
            if fit is not None and len(hosts) > 1:
                return fit[1] / (2 * (len(hosts) - 1))
        return None
