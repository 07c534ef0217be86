"""The auto rows' targets in bench_rollout.py: adaptive k (decoding/adaptive_k.py) against the best fixed chain k of
its (batch, tau) and against autoregressive sampling, from the rows' per-repeat paired speedups.

    per row:     auto >= best fixed k - 2 sd   (sd: of the per-repeat difference auto - best, paired: same prompts,
                                                seeds and machine moment)
                 auto >= 1 - 2 sd              (sd: auto's speedup_sd)
    across rows: geomean(auto) >= 0.98 x geomean(per-row best fixed k)
"""
from __future__ import annotations

import math
import statistics


def auto_targets(rows) -> dict:
    """Per (batch, tau): auto against the best fixed chain k (paired per repeat) and against autoregressive; the
    geometric means across rows."""
    out = []
    for a in (r for r in rows if r["k"] == "auto"):
        fixed = [r for r in rows if (r["batch"], r["temperature"]) == (a["batch"], a["temperature"])
                 and r["tree"] == [] and r["k"] != "auto"]
        best = max(fixed, key=lambda r: r["speedup"])
        diff = [x - y for x, y in zip(a["speedup_per_repeat"], best["speedup_per_repeat"])]
        sd_diff = statistics.stdev(diff) if len(diff) > 1 else 0.0
        out.append(dict(batch=a["batch"], temperature=a["temperature"], best_k=best["k"], best=best["speedup"],
                        best_sd=best["speedup_sd"], auto=a["speedup"], auto_sd=a["speedup_sd"],
                        diff_sd=round(sd_diff, 3), steps_at_k=a["auto"]["steps_at_k"], k_mode=a["auto"]["k_mode"],
                        k_mean=a["auto"]["k_mean"], alpha=a["auto"]["alpha"],
                        vs_best_ok=a["speedup"] >= best["speedup"] - 2 * sd_diff,
                        vs_ar_ok=a["speedup"] >= 1.0 - 2 * (a["speedup_sd"] or 0.0)))
    if not out:
        return dict(rows=[])
    gm = lambda xs: math.exp(statistics.mean(math.log(x) for x in xs))  # noqa: E731
    g_auto, g_best = gm([t["auto"] for t in out]), gm([t["best"] for t in out])
    return dict(rows=out, geomean_auto=round(g_auto, 3), geomean_best_fixed=round(g_best, 3),
                geomean_ok=g_auto >= 0.98 * g_best)


def markdown_auto(t) -> str:
    head = ("| batch | tau | best fixed k | its speedup | auto speedup | sd of auto - best | steps at k = 0..K | "
            "k auto ran most | auto >= best - 2 sd | auto >= 1 - 2 sd |\n|---:|---:|---:|---:|---:|---:|---|---:|---|---|")
    body = [f"| {r['batch']} | {r['temperature']:g} | {r['best_k']} | {r['best']:.2f}x ± {r['best_sd']:.2f} | "
            f"**{r['auto']:.2f}x** ± {r['auto_sd']:.2f} | {r['diff_sd']:.2f} | {r['steps_at_k']} | {r['k_mode']} | "
            f"{'yes' if r['vs_best_ok'] else 'NO'} | {'yes' if r['vs_ar_ok'] else 'NO'} |" for r in t["rows"]]
    foot = (f"geometric mean of the speedups: auto {t['geomean_auto']:.3f}, per-row best fixed k "
            f"{t['geomean_best_fixed']:.3f} (auto >= 0.98 x best: {'yes' if t['geomean_ok'] else 'NO'}); ± is the "
            "standard deviation over repeats of the paired per-repeat speedup") if t["rows"] else ""
    return "\n".join([head] + body) + "\n\n" + foot
