"""What a person reads about a plan: the summary table and a timeline picture."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hetero.cluster import Cluster
from hetero.memory import GIB
from hetero.plan import Plan
from hetero.predictor import Prediction


def _replica_groups(plan: Plan) -> list[tuple[int, str, int]]:
    """(count, devices, micro-batches) of identical replicas, in order of appearance."""
    keys = [(" + ".join(r.model_extra.get("device_types", ["?"])), r.num_micro_batches) for r in plan.replicas]
    counts = Counter(keys)
    seen, out = set(), []
    for key in keys:
        if key not in seen:
            seen.add(key)
            out.append((counts[key], *key))
    return out


def summary(plan: Plan, prediction: Prediction, cluster: Cluster, title: str) -> str:
    info = plan.model_extra.get("prediction", {})
    training = plan.model_extra.get("training", {})
    lines = [title, f"cluster    {cluster.describe()}"]
    if training:
        lines.append(
            f"training   global batch {plan.global_batch_size} x sequence {training.get('seq_length')}, "
            f"{training.get('precision')}, distributed optimizer "
            f"{'on' if training.get('distributed_optimizer') else 'off'}"
        )
    family = plan.model_extra.get("provenance", {}).get("family")
    lines.append(
        f"layout     TP={plan.tensor_parallel} PP={plan.pipeline_parallel} DP={plan.data_parallel}, "
        f"micro-batch {plan.micro_batch_size}" + (f", {family} replicas" if family else "")
    )
    lines.append("stages     stage  layers  devices")
    for s, stage in enumerate(plan.stages):
        devices = ", ".join(stage.model_extra.get("device_types", []))
        lines.append(f"           {s:5d}  {stage.num_layers:6d}  {devices}")
    lines.append("replicas   count  micro-batches  devices")
    for count, devices, micro in _replica_groups(plan):
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
    if "upper_bound" in info:
        line += (f" | {info['fraction_of_upper_bound']:.1%} of the upper bound "
                 f"({info['upper_bound']['tokens_per_s']:,.0f} tokens/s)")
    lines.append(line)
    baseline = info.get("baseline")
    if baseline:
        lines.append(
            f"baseline   Megatron TP={baseline['tensor_parallel']} PP={baseline['pipeline_parallel']} "
            f"DP={baseline['data_parallel']} micro-batch {baseline['micro_batch_size']} on "
            f"{baseline['devices']}: {baseline['iteration_time_s']:.3f} s, "
            f"{baseline['tokens_per_s']:,.0f} tokens/s -> speed-up {info['speedup_over_baseline']:.2f}x"
        )
    elif "baseline" in info:
        lines.append("baseline   no uniform Megatron plan fits this cluster")
    provenance = plan.model_extra.get("provenance", {})
    if "search_time_s" in provenance:
        lines.append(f"search     {provenance['search_time_s']:.2f} s, "
                     f"{provenance['candidates_estimated']} candidates estimated")
    if prediction.problems:
        lines.append("memory     DOES NOT FIT: " + "; ".join(prediction.problems[:4]))
    return "\n".join(lines)


def timeline_png(plan: Plan, prediction: Prediction, path: str | Path, max_replicas: int = 4) -> Path:
    """Gantt chart of one predicted iteration: forward, backward, gradient reduction, step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown, seen = [], set()
    for d, ops in prediction.timelines.items():  # one row set per distinct replica
        key = id(ops)
        if key not in seen:
            seen.add(key)
            shown.append(d)
        if len(shown) == max_replicas:
            break
    pp = plan.pipeline_parallel
    rows = [(d, s) for d in shown for s in range(pp)]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.6))
    colors = {"F": "#4C72B0", "B": "#DD8452", "reduce": "#8C8C8C", "step": "#55A868"}
    optimizer_start = prediction.iteration_time_s - prediction.optimizer_s
    for y, (d, s) in enumerate(rows):
        ops = prediction.timelines[d][s]
        for op in ops:
            ax.broken_barh([(op.start, op.end - op.start)], (y - 0.4, 0.8), facecolors=colors[op.kind],
                           edgecolor="white", linewidth=0.3)
        # The reduction completes only when the stage's last replica joins.
        ax.broken_barh([(prediction.stage_end_s[s], prediction.reduce_s[s])], (y - 0.4, 0.8),
                       facecolors=colors["reduce"])
        ax.broken_barh([(optimizer_start, prediction.optimizer_s)], (y - 0.4, 0.8), facecolors=colors["step"])
    labels = []
    for d, s in rows:
        devices = plan.replicas[d].model_extra.get("device_types")
        stage_device = plan.device_of_logical(plan.tensor_parallel * (d + plan.data_parallel * s)).device_type
        labels.append(f"replica {d} stage {s} ({stage_device}, {plan.stages[s].num_layers} layers, "
                      f"{plan.replicas[d].num_micro_batches} mb)" if devices is not None else f"r{d} s{s}")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"Predicted iteration: {prediction.iteration_time_s:.3f} s "
                 f"(TP={plan.tensor_parallel} PP={pp} DP={plan.data_parallel})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward", "backward", "gradient reduction", "optimizer step"],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / (0.45 * len(rows) + 1.6), 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_table(prediction: Prediction) -> str:
    lines = ["replica stage device              weights  grads  optim  activ  total (GiB)"]
    for r in prediction.reports[:64]:
        m = r.memory
        lines.append(f"{r.slot.replica:7d} {r.slot.stage:5d} {r.slot.device_type:18s} "
                     f"{m.weights / GIB:7.2f} {m.gradients / GIB:6.2f} {m.optimizer / GIB:6.2f} "
                     f"{m.activations / GIB:6.2f} {m.total / GIB:7.2f}")
    return "\n".join(lines)
