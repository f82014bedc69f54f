"""report.md of bench/emulated_bench.py: its results as tables, and what they add up to."""

from __future__ import annotations

import statistics


def report(results: dict) -> str:
    rows = results["predictor"]
    lines = ["## Predictor vs measured (emulated clusters, profiles taken on them)", "",
             "Predicted with the median of two short compute profiles of the plan's cases, taken "
             "right before and right after its timed runs (links from the cluster's profile); the "
             "last column predicts from the cluster's profile taken before all its runs, which the "
             "planner planned with.", "",
             "| cluster | plan | layout | measured s/iter (median) | spread | predicted | error | "
             "memory measured vs predicted (MB) | error, cluster's profile |",
             "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        memory = "; ".join(f"s{m['stage']} {m['measured_mb']:.0f} vs {m['predicted_mb']:.0f} ({m['error']:+.1%})"
                           for m in r["memory"])
        lines.append(f"| {r['cluster']} | {r['plan']} | {r['layout']} | {r['measured_s']:.3f} | "
                     f"{r['spread']:.1%} | {r['predicted_s']:.3f} | {r['time_error']:+.1%} | {memory} | "
                     f"{r['time_error_before']:+.1%} |")
    time_mae = statistics.mean(abs(r["time_error"]) for r in rows)
    before_mae = statistics.mean(abs(r["time_error_before"]) for r in rows)
    memory_mae = statistics.mean(abs(m["error"]) for r in rows for m in r["memory"])
    lines += ["", f"Mean absolute error: iteration time {time_mae:.1%}, peak memory {memory_mae:.1%} "
              f"over {len(rows)} plans (target <= 5%); iteration time from the cluster's profile "
              f"{before_mae:.1%}.", ""]
    i = results.get("interleaved")
    if i:
        lines += ["## Interleaved 1F1B against plain 1F1B (the demo's plan)", "",
                  f"- plain over interleaved iteration time: measured {i['measured_speedup']:.2f}x, "
                  f"predicted {i['predicted_speedup']:.2f}x",
                  f"- prediction error: interleaved {i['errors']['interleaved']:+.1%}, "
                  f"plain {i['errors']['plain']:+.1%}", ""]
    t = results.get("templates")
    if t:
        lines += ["## Replica templates against one template, side by side", "",
                  f"- planner ({t['num_templates']} template(s)): {t['templated_layout']}",
                  f"- planner, --no-templates: {t['one_template_layout']}",
                  f"- one-template over templated iteration time: measured {t['measured_speedup']:.2f}x, "
                  f"predicted {t['predicted_speedup']:.2f}x",
                  f"- prediction error: templated {t['errors']['templated']:+.1%}, "
                  f"one template {t['errors']['one_template']:+.1%}; spread {t['spreads']['templated']:.1%}, "
                  f"{t['spreads']['one_template']:.1%}",
                  "- load (1, 5, 15 min) before: " + ", ".join(f"{x:.1f}" for x in t["load_before"])
                  + "; after: " + ", ".join(f"{x:.1f}" for x in t["load_after"]), ""]
    q = results.get("quality")
    if q:
        compute = [r for r in rows if r["cluster"] == "compute"]
        planned = next(r for r in compute if r["plan"] == "planner")
        slack = max(r["spread"] for r in compute)
        faster = [r for r in compute if r["measured_s"] < planned["measured_s"] * (1 - slack)]
        lines += ["## Plan quality (compute cluster: 3 fast + 1 half-speed device)", "",
                  f"- planner ({q['planner_layout']}): {q['planner_tokens_per_s']:.0f} tokens/s",
                  f"- Megatron baseline ({q['baseline_layout']}): {q['baseline_tokens_per_s']:.0f} tokens/s",
                  f"- speed-up {q['speedup']:.2f}x (target >= 1.5x)",
                  "- upper bound (each type alone, summed): " + " + ".join(
                      f"{t} {v:.0f}" for t, v in q["alone_tokens_per_s"].items())
                  + f" = {q['upper_bound_tokens_per_s']:.0f} tokens/s; planner reaches "
                    f"{q['fraction_of_upper_bound']:.1%} (target >= 95%)",
                  f"- plans measured faster than the planner's beyond the largest spread ({slack:.1%}): "
                  + (", ".join(f"{r['plan']} ({r['measured_s']:.3f} s)" for r in faster) or "none"), ""]
    n = results.get("nic")
    if n:
        lines += ["## NIC awareness (2 InfiniBand + 2 Ethernet nodes, listed interleaved)", "",
                  f"- planner's order {n['aware_rank_order']} ({n['layout']}): {n['aware_tokens_per_s']:.0f} tokens/s",
                  f"- same plan in launch order: {n['launch_order_tokens_per_s']:.0f} tokens/s",
                  f"- NIC-aware / launch order: {n['speedup']:.2f}x",
                  f"- PP=2 x DP=2 in the predictor's order {n['pp_aware']['layout'].split('order ')[1]}: "
                  f"{n['pp_aware']['measured_tokens_per_s']:.0f} tokens/s, in the other order "
                  f"{n['pp_other']['layout'].split('order ')[1]}: {n['pp_other']['measured_tokens_per_s']:.0f} "
                  f"tokens/s -> {n['pp_speedup']:.2f}x", ""]
    return "\n".join(lines)
