"""The job to plan, as one typed value: the cluster, the model, the global batch, the search's
options (with the training set-up: precision, optimizer, recomputation, ...), the objective,
the profiles and how the run pads its vocabulary. hetero-plan builds one from its command
line (hetero/cli.py); a re-plan after a lost or returned node builds one from the plan's
record (``Job.of_record``); both plan it through the same function (hetero/jobs.plan).

The vocabulary is part of the job because the run pads it for the plan's tensor-parallel
degrees (Megatron-LM: to a multiple of --make-vocab-size-divisible-by times the degree): a
plan made at one padding and run at another would be refused. A job that resumes a
checkpoint keeps the padding it was trained with (``kept_vocab_size``): a re-plan at other
degrees finds the divisor that gives that padding there, or leaves those degrees out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Literal

from hetero.errors import PlanError
from hetero.predict.economics import Economics
from hetero.predict.training_setup import TrainingSetup
from hetero.search.options import PlannerOptions
from hetero.spec.cluster import Cluster
from hetero.spec.megatron_args import VocabularyPadding
from hetero.spec.model import ModelSpec
from hetero.spec.profiles import Profiles

@dataclass(frozen=True)
class Objective:
    """What the plan is chosen for.

    throughput: the most tokens/s (under max_dollars_per_hour, when given);
    cost: the fewest $ per token; energy: the fewest J per token (each at least
    min_tokens_per_s, and under max_dollars_per_hour, when given).
    """

    goal: Literal["throughput", "cost", "energy"] = "throughput"
    min_tokens_per_s: float | None = None
    max_dollars_per_hour: float | None = None

    @property
    def plain(self) -> bool:
        """The planner's own objective: every device, fastest plan."""
        return self.goal == "throughput" and self.max_dollars_per_hour is None

    def describe(self) -> str:
        text = {"throughput": "the most tokens/s", "cost": "the fewest $ per token",
                "energy": "the fewest J per token"}[self.goal]
        if self.min_tokens_per_s is not None:
            text += f", at least {self.min_tokens_per_s:,.0f} tokens/s"
        if self.max_dollars_per_hour is not None:
            text += f", at most ${self.max_dollars_per_hour:,.2f}/h"
        return text

    def needs(self) -> list[str]:
        """The device facts it prices with."""
        needs = []
        if self.goal == "cost" or self.max_dollars_per_hour is not None:
            needs.append("price_per_hour")
        if self.goal == "energy":
            needs.append("board_power_w")
        return needs

    def admits(self, e: Economics) -> bool:
        if self.min_tokens_per_s is not None and e.tokens_per_s < self.min_tokens_per_s:
            return False
        return self.max_dollars_per_hour is None or e.dollars_per_hour <= self.max_dollars_per_hour

    def better(self, a: Economics, b: Economics) -> bool:
        """a is preferred to b."""
        if self.goal == "cost":
            return a.dollars_per_million_tokens < b.dollars_per_million_tokens
        if self.goal == "energy":
            return a.joules_per_token < b.joules_per_token
        return a.tokens_per_s > b.tokens_per_s


@dataclass(frozen=True)
class Job:
    """What to plan (module docstring)."""

    cluster: Cluster
    model: ModelSpec
    """The model; with ``vocabulary``, its vocab_size is re-padded for each plan's degrees."""
    global_batch_size: int
    options: PlannerOptions = PlannerOptions()
    objective: Objective = Objective()
    profiles: Profiles | None = None
    profiles_source: str | None = None
    precision: str | None = "from-options"
    """"from-options": the set-up's on every device; None: the planner's pick; a name: that one."""
    vocabulary: VocabularyPadding | None = None
    kept_vocab_size: int | None = None
    """A resumed job's trained (padded) vocabulary, which every re-plan keeps."""
    pipeline_parallel: int | None = None
    """The pipeline depth the flags fix (the planner keeps to it)."""

    @property
    def setup(self) -> TrainingSetup:
        return self.options.setup

    def model_for(self, degrees: Iterable[int]) -> ModelSpec:
        """The model the run builds at these tensor-parallel degrees (its padded vocabulary)."""
        if self.kept_vocab_size is not None:
            return dataclasses.replace(self.model, vocab_size=self.kept_vocab_size)
        if self.vocabulary is None:
            return self.model
        return dataclasses.replace(self.model, vocab_size=self.vocabulary.padded(tuple(degrees)))

    def divisor_for(self, degrees: Iterable[int]) -> int | None:
        """The --make-vocab-size-divisible-by that gives the run this job's vocabulary at these
        degrees (None: the job records no tokenizer, or none gives it)."""
        if self.vocabulary is None:
            return None
        degrees = tuple(degrees)
        padded = self.kept_vocab_size or self.vocabulary.padded(degrees)
        return self.vocabulary.divisor_giving(padded, degrees)

    def profiles_for(self, model: ModelSpec) -> Profiles | None:
        """The profiles, those measured at another padding of this job's vocabulary standing
        for this one: the profiler pads for the degrees it measured, the run for the plan's;
        the logits layer differs by a few rows."""
        if self.profiles is None or self.vocabulary is None:
            return self.profiles
        aligned = []
        for profile in self.profiles.compute:
            vocab = profile.model.get("vocab_size")
            if isinstance(vocab, int) and vocab != model.vocab_size and self.vocabulary.is_padding(vocab):
                profile = profile.model_copy(update={"model": {**profile.model, "vocab_size": model.vocab_size}})
            aligned.append(profile)
        return Profiles(aligned, self.profiles.link_profiles)

    @classmethod
    def of_record(cls, plan, cluster: Cluster | None = None, source: str = "the plan") -> "Job":
        """The job a plan written by hetero-plan records (hetero/record.py), for ``cluster``
        (default: the one recorded): the same model, global batch, micro-batch size and set-up;
        a resumed run's vocabulary kept as trained."""
        missing = [name for name in ("cluster", "model", "training") if getattr(plan, name) is None]
        if missing:
            raise PlanError(f"{source} has no {', '.join(missing)} section; a plan written by "
                            "hetero-plan records them")
        training = plan.training
        profiles_source = plan.provenance.profiles if plan.provenance is not None else None
        model = plan.model.spec()
        vocabulary = None
        if training.tokenizer_vocab_size is not None and training.make_vocab_size_divisible_by is not None:
            vocabulary = VocabularyPadding(training.tokenizer_vocab_size, training.make_vocab_size_divisible_by)
        setup = TrainingSetup(**training.setup_fields())
        return cls(cluster or Cluster(plan.cluster, f"{source}: cluster"), model, plan.global_batch_size,
                   PlannerOptions(micro_batch_sizes=(plan.micro_batch_size,), setup=setup), profiles=(
                       Profiles.load_dir(profiles_source) if profiles_source else None),
                   profiles_source=profiles_source, precision="from-options", vocabulary=vocabulary,
                   kept_vocab_size=model.vocab_size if vocabulary is not None else None)
