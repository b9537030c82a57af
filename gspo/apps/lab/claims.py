"""The GSPO paper's claims C1-C5, measured on a lab's runs: one row each, with a verdict.

Pure functions of the run summaries (`gspo.apps.lab.report.summarize_run`). A verdict compares means over
seeds with their standard error (`gspo.apps.lab.stats.compare`): a difference counts only beyond 2 SE.
"""

from __future__ import annotations

import numpy as np

from gspo.apps.lab.regimes import levels
from gspo.apps.lab.stats import compare, fmt, markdown_table, select, stat

# What the paper (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071) reports.
PAPER = {
    "C1": "GSPO trains more efficiently than GRPO: higher training reward and benchmark scores at equal "
          "training compute (Fig. 1, Qwen3-30B-A3B cold-start model).",
    "C2": "GSPO clips far more than GRPO (fraction of clipped sequences/tokens ~0.15 vs ~0.0013, two orders of "
          "magnitude, Fig. 2), yet learns faster.",
    "C3": "In the 48-layer Qwen3-30B-A3B MoE, ~10% of the experts activated for the same input change after "
          "each gradient update (sec. 5.3); the effect is tied to model size/depth.",
    "C4": "MoE: GRPO without Routing Replay does not converge; with it, it does; GSPO converges without it (Fig. 3).",
    "C5": "Token-level importance ratios add high-variance noise that grows with length; the sequence-level "
          "ratio is steadier (sec. 3-4).",
}


def claims(runs: list[dict]) -> list[dict]:
    """One row per claim: paper, measured (text), verdict (reproduced / not reproduced / partly / n/a)."""
    main = select(runs, group="main")
    return [_c1_efficiency(main), _c2_clipping(main), _c3_routing_drift(main, select(runs, group="depth")),
            _c4_moe_stability(main), _c5_ratio_spread(main)]


def _row(claim: str, parts: list[str], verdict: str, rule: str = "") -> dict:
    return {"claim": claim, "paper": PAPER[claim], "measured": "; ".join(parts) or "not measured in this lab",
            "verdict": verdict, "rule": rule}


def _acc(main: list[dict], objective: str, model: str, replay: str = "none", key: str = "acc_mean") -> dict:
    """`stat` over seeds of one main-grid configuration's accuracy (`key` of its run summaries)."""
    return stat(r[key] for r in select(main, objective=objective, model=model, replay=replay))


def _c1_efficiency(main: list[dict]) -> dict:
    """C1: learning efficiency, GSPO vs GRPO without replay, per architecture."""
    parts, verdicts = [], []
    for model in ("dense", "moe"):
        g, r = _acc(main, "gspo", model), _acc(main, "grpo", model)
        if not (g["n"] and r["n"]):
            continue
        diff, se, how = compare(g, r)
        gf, rf = _acc(main, "gspo", model, key="acc_final"), _acc(main, "grpo", model, key="acc_final")
        parts.append(f"{model}: mean held-out mean@k over the run GSPO {fmt(g)} vs GRPO {fmt(r)} "
                     f"(Δ {100 * diff:+.1f} ± {100 * se:.1f} pts); final {fmt(gf)} vs {fmt(rf)}")
        verdicts.append(how)
    return _row("C1", parts, "reproduced" if verdicts and all(v == "higher" for v in verdicts) else
                "partly" if "higher" in verdicts else "not reproduced" if verdicts else "n/a")


def _c2_clipping(main: list[dict]) -> dict:
    """C2: clipping, GSPO (sequences) vs GRPO (tokens)."""
    parts, ratios = [], []
    for model in ("dense", "moe"):
        g = stat(r["clip"] for r in select(main, objective="gspo", model=model, replay="none"))
        r_ = stat(r["clip"] for r in select(main, objective="grpo", model=model, replay="none"))
        if not (g["n"] and r_["n"]):
            continue
        if g["mean"] <= 0:
            parts.append(f"{model}: GSPO clipped nothing")
            continue
        ratio = g["mean"] / r_["mean"] if r_["mean"] > 0 else float("inf")
        ratios.append(ratio)
        parts.append(f"{model}: clipped fraction GSPO {fmt(g, digits=2)} (sequences) vs GRPO {fmt(r_, digits=3)} "
                     f"(tokens): " + (f"{ratio:.0f}x" if r_["mean"] > 0 else "GRPO clipped nothing"))
    return _row("C2", parts, "n/a" if not ratios else "reproduced" if all(x >= 10 for x in ratios) else
                "partly" if any(x >= 10 for x in ratios) else "not reproduced",
                "reproduced = GSPO clips >= 10x more (paper: ~100x); whether it also learns faster is C1")


def _c3_routing_drift(main: list[dict], depth: list[dict]) -> dict:
    """C3: routing drift per update, and its growth with depth (depth sweep, GRPO without replay)."""
    by_depth = {d: stat(r["drift"] for r in select(depth, layers=d))
                for d in sorted({r["spec"]["layers"] for r in depth})}
    drift_main = stat(r["drift"] for r in select(main, model="moe", replay="none"))
    parts, verdict = [], "n/a"
    if drift_main["n"]:
        parts.append(f"main MoE runs (free routing): {fmt(drift_main, digits=2)} of expert choices change per update "
                     f"(paper: ~10% at 48 layers)")
    if len(by_depth) >= 2:
        xs = [d for d in by_depth if by_depth[d]["n"]]
        slope = np.polyfit(xs, [by_depth[d]["mean"] for d in xs], 1)[0] if len(xs) >= 2 else float("nan")
        parts.append("depth sweep: " + ", ".join(f"{d} layers {fmt(s, digits=2)}" for d, s in by_depth.items()) +
                     f"; slope {100 * slope:+.3f} pts/layer")
        lo, hi = by_depth[xs[0]], by_depth[xs[-1]]
        grows, big = compare(hi, lo)[2] == "higher", hi["mean"] >= 0.05
        verdict = "reproduced" if grows and big else "partly" if grows else "not reproduced"
        parts.append(("drift grows with depth" if grows else "no growth with depth beyond the seed spread") +
                     ("" if big or hi["mean"] <= 0 else f"; at {xs[-1]} layers it is {0.10 / hi['mean']:.0f}x "
                                                          "below the paper's 10%"))
    elif drift_main["n"]:  # one shape only (a regime): the size of the drift alone
        verdict = "reproduced" if drift_main["mean"] >= 0.05 else "partly" if drift_main["mean"] >= 0.01 else \
            "not reproduced"
    return _row("C3", [p for p in parts if p], verdict,
                "reproduced = drift grows with depth and reaches >= 5%; partly = grows but stays small; without "
                "a depth sweep: >= 5% reproduced, >= 1% partly")


def _c4_moe_stability(main: list[dict]) -> dict:
    """C4: MoE stability: GRPO without replay vs GRPO with replay vs GSPO without replay."""
    parts, verdict = [], "n/a"
    gn, gr, sn = (_acc(main, "grpo", "moe"), _acc(main, "grpo", "moe", "old_policy"), _acc(main, "gspo", "moe"))
    if gn["n"] and gr["n"] and sn["n"]:
        col = {k: sum(r["collapse_step"] is not None for r in select(main, objective=o, model="moe", replay=rp))
               for k, (o, rp) in {"grpo": ("grpo", "none"), "replay": ("grpo", "old_policy"),
                                  "gspo": ("gspo", "none")}.items()}
        parts.append(f"mean held-out mean@k: GRPO no replay {fmt(gn)}, GRPO + replay {fmt(gr)}, GSPO no replay "
                     f"{fmt(sn)}; collapsed runs {col['grpo']}/{gn['n']}, {col['replay']}/{gr['n']}, "
                     f"{col['gspo']}/{sn['n']}")
        worse_than_replay = compare(gr, gn)[2] == "higher" or col["grpo"] > col["replay"]
        worse_than_gspo = compare(sn, gn)[2] == "higher" or col["grpo"] > col["gspo"]
        verdict = ("reproduced" if worse_than_replay and worse_than_gspo else
                   "partly" if worse_than_replay or worse_than_gspo else "not reproduced")
        if verdict == "not reproduced":
            parts.append("GRPO without replay trains as well as the other two at this scale")
    return _row("C4", parts, verdict)


def _c5_ratio_spread(main: list[dict]) -> dict:
    """C5: ratio spread (GRPO: token ratios, GSPO: length-normalised sequence ratios) and gradient-norm spread."""
    parts, verdicts = [], []
    for model in ("dense", "moe"):
        rg = stat(r["ratio_std"] for r in select(main, objective="grpo", model=model, replay="none"))
        rs = stat(r["ratio_std"] for r in select(main, objective="gspo", model=model, replay="none"))
        gg = stat(r["grad_norm_rel_std"] for r in select(main, objective="grpo", model=model, replay="none"))
        gs = stat(r["grad_norm_rel_std"] for r in select(main, objective="gspo", model=model, replay="none"))
        if not (rg["n"] and rs["n"]):
            continue
        verdicts.append((compare(rs, rg)[2], compare(gs, gg)[2]))
        parts.append(f"{model}: importance-ratio std GSPO {fmt(rs, False, 2)} vs GRPO {fmt(rg, False, 2)}; "
                     f"grad-norm spread across minibatches (std/mean) GSPO {fmt(gs, False, 2)} "
                     f"vs GRPO {fmt(gg, False, 2)}")
    ratio_lower = [r == "lower" for r, _ in verdicts]
    grad_higher = [g == "higher" for _, g in verdicts]
    verdict = ("n/a" if not verdicts else "not reproduced" if not any(ratio_lower) else
               "reproduced" if all(ratio_lower) and not any(grad_higher) else "partly")
    return _row("C5", parts, verdict, "reproduced = GSPO's ratio spread is lower beyond 2 SE and its "
                "gradient-norm spread is not higher; the sequence ratio is a geometric mean of token ratios, "
                "so its lower spread is expected by construction: the gradient half is the real test")


# ------------------------------------------------------------------------------- per regime
def plain_methods(methods: dict) -> set[str]:
    """The regime methods that set only the objective and the routing replay: the runs the claims compare."""
    return {name for name, overrides in methods.items() if set(overrides) <= {"objective", "routing_replay"}}


def regime_claims(runs: list[dict], lab_config: dict) -> dict[str, list[dict]]:
    """regime -> `claims` of its runs: its plain methods (GRPO, GSPO, GRPO + replay) read as a main grid.
    `lab_config`: the lab's settings as lab.json holds them."""
    plain = plain_methods(lab_config.get("regime_methods", {}))
    out = {}
    for label, _ in levels(lab_config.get("regimes", {})):
        picked = [{**r, "spec": {**r["spec"], "group": "main"}} for r in select(runs, group="regime", label=label)
                  if r["spec"]["method"] in plain]
        if picked:
            out[label] = claims(picked)
    return out


def regime_claims_section(runs: list[dict], lab_config: dict) -> list[str]:
    """report.md's lines: a verdict per claim and regime, then what was measured."""
    by_regime = regime_claims(runs, lab_config)
    if not by_regime:
        return []
    names = list(PAPER)
    out = ["## Claims per regime", "",
           "The claims above, measured in each regime on its GRPO, GSPO and GRPO + routing replay runs (mean ± std "
           "over seeds; a difference counts beyond 2 standard errors; n/a: the regime lacks the runs the claim "
           "compares).", "",
           markdown_table(["regime", *names], [[label, *(c["verdict"] for c in rows)] for label, rows in
                                              by_regime.items()]), ""]
    for label, rows in by_regime.items():
        out += [f"- **{label}**: " + " ".join(f"{c['claim']}: {c['measured']}." for c in rows
                                              if c["verdict"] != "n/a")]
    return out + [""]
