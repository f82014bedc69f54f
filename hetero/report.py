"""What a person reads about a plan: the summary table and a timeline picture."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Sequence

from hetero.errors import HeteroError
from hetero.events import iteration_times_s, read_events
from hetero.spec.cluster import Cluster
from hetero.predict.memory import GIB
from hetero.plan import Plan
from hetero.predict.predictor import Prediction


def _replica_groups(replicas) -> list[tuple[int, str, int]]:
    """(count, devices, micro-batches) of identical replicas, in order of appearance."""
    keys = [(" + ".join(r.device_types or ["?"]), r.num_micro_batches) for r in replicas]
    counts = Counter(keys)
    seen, out = set(), []
    for key in keys:
        if key not in seen:
            seen.add(key)
            out.append((counts[key], *key))
    return out


def _per_token_text(record) -> str:
    """'$0.42 per 1M tokens | 0.31 J/token' from a prediction or baseline record ('' when
    neither is known)."""
    parts = []
    if record.dollars_per_million_tokens is not None:
        parts.append(f"${record.dollars_per_million_tokens:.3g} per 1M tokens")
    if record.joules_per_token is not None:
        parts.append(f"{record.joules_per_token:.3g} J/token (devices at board power)")
    return " | ".join(parts)


def summary(plan: Plan, prediction: Prediction, cluster: Cluster, title: str) -> str:
    info, training, provenance = plan.prediction, plan.training, plan.provenance
    lines = [title, f"cluster    {cluster.describe()}"]
    if training is not None:
        lines.append(
            f"training   global batch {plan.global_batch_size} x sequence {training.seq_length}, "
            f"{training.precision}, distributed optimizer "
            f"{'on' if training.distributed_optimizer else 'off'}, sequence parallel "
            f"{'on' if training.sequence_parallel else 'off'}, "
            f"{training.virtual_stages} virtual stage(s) per stage"
        )
        if training.precision_reason:
            lines.append(f"precision  {training.precision_reason}")
    family = provenance.family if provenance is not None else None
    several = plan.num_templates > 1
    if several:
        lines.append(f"layout     {plan.num_templates} replica templates, micro-batch {plan.micro_batch_size}"
                     + (f", {family} replicas" if family else ""))
    for k, template in enumerate(plan.templates):
        shape = (f"TP={_degrees(template)} PP={template.pipeline_parallel} DP={template.data_parallel}"
                 + (f" EP={plan.expert_parallel}" if plan.expert_parallel > 1 else "")
                 + (f" ETP={plan.expert_tensor_parallel}" if plan.expert_tensor_parallel is not None else ""))
        if several:
            lines.append(f"template {k} {shape}")
        else:
            lines.append(f"layout     {shape}, micro-batch {plan.micro_batch_size}"
                         + (f", {family} replicas" if family else ""))
        lines.append("stages     stage  layers  recompute  devices")
        for s, stage in enumerate(template.stages):
            devices = ", ".join(stage.device_types or [])
            recompute = stage.recompute_mode() or (training.recompute if training is not None else "none")
            lines.append(f"           {s:5d}  {stage.num_layers:6d}  {recompute:9s}  {devices}")
        lines.append("replicas   count  micro-batches  devices")
        for count, devices, micro in _replica_groups(template.replicas):
            lines.append(f"           {count:5d}  {micro:13d}  {devices}")
    lines.append("devices    type                count  used  TFLOPS/device  peak memory  capacity  headroom")
    used = Counter(d.device_type for d in plan.devices)
    for device_type, count in cluster.device_counts().items():
        if device_type in prediction.peak_memory_gib:
            peak = prediction.peak_memory_gib[device_type]
            capacity = cluster.devices[device_type].memory_gib
            tflops = prediction.tflops_per_device[device_type]
            lines.append(
                f"           {device_type:18s} {count:6d} {used[device_type]:5d}  "
                f"{tflops:13.{1 if tflops >= 1 else 4}f}  {peak:8.1f} GiB  "
                f"{capacity:5g} GiB  {1 - peak / capacity:7.0%}"
            )
        else:
            lines.append(f"           {device_type:18s} {count:6d} {0:5d}  (not used)")
    line = (f"predicted  iteration {prediction.iteration_time_s:.3f} s | "
            f"{prediction.tokens_per_s:,.0f} tokens/s")
    if info is not None and info.upper_bound is not None:
        line += (f" | {info.fraction_of_upper_bound:.1%} of the upper bound "
                 f"({info.upper_bound.tokens_per_s:,.0f} tokens/s)")
    lines.append(line)
    if info is not None and info.fraction_of_upper_bound is not None and info.fraction_of_upper_bound > 1:
        lines.append("           (above 100%: the bound is each device type training alone; together a "
                     "type can run a cheaper layout, holding fewer layers with less sharding, "
                     "recomputation or pipeline bubble, than it needs alone)")
    if info is not None and (cost := _per_token_text(info)):
        lines.append(f"per token  {cost}")
    if info is not None and info.objective:
        lines.append(f"objective  {info.objective}")
    baseline = info.baseline if info is not None else None
    if baseline is not None:
        lines.append(
            f"baseline   Megatron TP={baseline.tensor_parallel} PP={baseline.pipeline_parallel} "
            f"DP={baseline.data_parallel} micro-batch {baseline.micro_batch_size} on "
            f"{baseline.devices}: {baseline.iteration_time_s:.3f} s, "
            f"{baseline.tokens_per_s:,.0f} tokens/s -> speed-up {info.speedup_over_baseline:.2f}x"
        )
        if cost := _per_token_text(baseline):
            lines.append(f"           baseline per token: {cost}")
    elif info is not None and "baseline" in info.model_fields_set:
        lines.append("baseline   no uniform Megatron plan fits this cluster")
    if provenance is not None and provenance.search_time_s is not None:
        candidates = provenance.candidates_estimated
        lines.append(f"search     {provenance.search_time_s:.2f} s"
                     + (f", {candidates} candidates estimated" if candidates is not None else ""))
    if prediction.problems:
        lines.append("memory     DOES NOT FIT: " + "; ".join(prediction.problems[:4]))
    return "\n".join(lines)


COLORS = {"F": "#4C72B0", "B": "#DD8452", "reduce": "#8C8C8C", "step": "#55A868"}
LEGEND = ["forward", "backward", "gradient reduction", "optimizer step"]
Span = tuple[str, float, float]  # kind, start s, end s


def _shown_replicas(plan: Plan, prediction: Prediction, max_replicas: int) -> list[int]:
    """One replica per distinct timeline, every template's first ones among them."""
    shown, seen = [], set()
    per_template = max(1, max_replicas // plan.num_templates)
    for k in range(plan.num_templates):
        first = plan.grid.replica_offsets[k]
        taken = 0
        for d in range(first, plan.grid.replica_offsets[k + 1]):  # one row set per distinct replica
            ops = prediction.timelines[d]
            if id(ops) not in seen:
                seen.add(id(ops))
                shown.append(d)
                taken += 1
            if taken == per_template:
                break
    return shown


def _stage_index(plan: Plan, d: int, s: int) -> int:
    """Where replica d's stage s is in a prediction's stage lists (every template's stages,
    template by template)."""
    k = plan.template_of_replica(d)
    return sum(t.pipeline_parallel for t in plan.templates[:k]) + s


def _predicted_spans(plan: Plan, prediction: Prediction, d: int, s: int) -> list[Span]:
    spans = [(op.kind, op.start, op.end) for op in prediction.timelines[d][s]]
    # The reduction completes only when the stage's last replica joins (with several templates,
    # the last replica of any template).
    i = _stage_index(plan, d, s)
    start = prediction.stage_end_s[i] if prediction.reduction_start_s is None else prediction.reduction_start_s
    spans.append(("reduce", start, start + prediction.reduce_s[i]))
    step_start = prediction.iteration_time_s - prediction.optimizer_s
    spans.append(("step", step_start, prediction.iteration_time_s))
    return spans


def _row_label(plan: Plan, d: int, s: int) -> str:
    stage_device = plan.stage_device(d, s).device_type
    k = plan.template_of_replica(d)
    where = f"template {k} " if plan.num_templates > 1 else ""
    return (f"{where}replica {d} stage {s} ({stage_device}, {plan.template(k).stages[s].num_layers} layers, "
            f"{plan.replicas[d].num_micro_batches} mb)")


def _rows(plan: Plan, replicas: Sequence[int]) -> list[tuple[int, int]]:
    return [(d, s) for d in replicas for s in range(plan.template(plan.template_of_replica(d)).pipeline_parallel)]


def _layout_title(plan: Plan) -> str:
    return " | ".join(f"TP={_degrees(t)} PP={t.pipeline_parallel} DP={t.data_parallel}" for t in plan.templates)


def _draw(ax, rows: list[list[Span]], labels: list[str], title: str) -> None:
    for y, spans in enumerate(rows):
        for kind, start, end in spans:
            ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), facecolors=COLORS[kind],
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)


def _save(fig, path: str | Path, height: float) -> Path:
    import matplotlib.pyplot as plt

    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, LEGEND, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(plan: Plan, prediction: Prediction, path: str | Path, max_replicas: int = 4) -> Path:
    """Gantt chart of one predicted iteration: forward, backward, gradient reduction, step."""
    plt = _pyplot()
    rows = _rows(plan, _shown_replicas(plan, prediction, max_replicas))
    height = 0.45 * len(rows) + 1.6
    fig, ax = plt.subplots(figsize=(12, height))
    _draw(ax, [_predicted_spans(plan, prediction, d, s) for d, s in rows], [_row_label(plan, d, s) for d, s in rows],
          f"Predicted iteration: {prediction.iteration_time_s:.3f} s ({_layout_title(plan)})")
    ax.set_xlabel("seconds")
    return _save(fig, path, height)


def measured_timeline_png(plan: Plan, prediction: Prediction, traces: list[dict], path: str | Path,
                          max_replicas: int = 4) -> Path:
    """A measured iteration (megatron.hetero.tracing) above its prediction, same rows and axis."""
    plt = _pyplot()
    traced = {(t["dp_rank"], t["pp_rank"]): t for t in traces if t["tp_rank"] == 0}
    rows = [row for row in _rows(plan, range(plan.data_parallel)) if row in traced]
    rows = rows[: max_replicas * max(t.pipeline_parallel for t in plan.templates)]
    measured = [[(kind, start, end) for kind, _, start, end in traced[row]["spans"]] for row in rows]
    measured_end = max((end for spans in measured for _, _, end in spans), default=0.0)
    height = 2 * (0.45 * len(rows) + 0.8) + 0.8
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, height), sharex=True)
    labels = [_row_label(plan, d, s) for d, s in rows]
    _draw(top, measured, labels, f"Measured iteration: {measured_end:.3f} s (emulated cluster)")
    _draw(bottom, [_predicted_spans(plan, prediction, d, s) for d, s in rows], labels,
          f"Predicted: {prediction.iteration_time_s:.3f} s ({_layout_title(plan)})")
    bottom.set_xlabel("seconds")
    return _save(fig, path, height)


# Megatron-LM's iteration line, for a log someone hands us (Megatron-LM's own included);
# a run of ours is read from its events (hetero.events), not from its log.
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def logged_iteration_times_s(log: str) -> list[float]:
    """Every "elapsed time per iteration" of a Megatron log, in seconds (each the mean
    over its log interval)."""
    return [float(ms) / 1e3 for ms in _ELAPSED.findall(log)]


def measured_iteration_times_s(source: str | Path) -> list[float]:
    """A run's logged iteration times: from its events directory (HETERO_EVENTS_DIR), or
    parsed from its log file."""
    path = Path(source)
    if path.is_dir():
        return iteration_times_s(read_events(path))
    if not path.is_file():
        raise HeteroError(f"{source} does not exist; give a training log, or the run's events "
                          "directory (HETERO_EVENTS_DIR)")
    return logged_iteration_times_s(path.read_text(errors="replace"))


def measured_against_predicted(times_s: Sequence[float], prediction_s: float) -> str:
    """The median logged iteration time after the first log line (start-up and the first
    allocations) against the prediction."""
    times = list(times_s)[1:]
    if not times:
        return "measured   no iteration time logged after the first log line"
    measured = statistics.median(times)
    return (f"measured   iteration {measured:.3f} s (median of {len(times)} logged intervals after the first) "
            f"vs predicted {prediction_s:.3f} s: prediction {prediction_s / measured - 1:+.1%}")


def memory_table(prediction: Prediction) -> str:
    lines = ["replica stage device              weights  grads  optim  activ  total (GiB)"]
    for r in prediction.reports[:64]:
        m = r.memory
        lines.append(f"{r.slot.replica:7d} {r.slot.stage:5d} {r.slot.device_type:18s} "
                     f"{m.weights / GIB:7.2f} {m.gradients / GIB:6.2f} {m.optimizer / GIB:6.2f} "
                     f"{m.activations / GIB:6.2f} {m.total / GIB:7.2f}")
    return "\n".join(lines)


def _degrees(template) -> str:
    """A template's tensor-parallel degree, or each stage's (plan version 3)."""
    degrees = template.stage_tensor_parallel
    return "/".join(map(str, degrees)) if len(set(degrees)) > 1 else str(degrees[0])
