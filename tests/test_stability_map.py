"""The stability map (gspo/apps/lab/stability_map.py) on synthetic run summaries, cells computed by hand."""

import pytest

from gspo.apps.lab.report import precursor
from gspo.apps.lab.stability_map import details_table, draw_drift_per_layer, draw_map, map_table, stability_map


def run(method, regime, start, final, collapse_step=None):
    return {"spec": {"method": method, "regime": regime}, "acc_start": start, "acc_final": final,
            "collapse_step": collapse_step}


RUNS = [
    # fp32: gains grpo (.30, .34, .32) mean .32 std .02, gspo (.28, .30, .32) mean .30 std .02: difference .02,
    # SE sqrt(.02^2/3 + .02^2/3) = .0163, not beyond 2 SE: nothing separates; both learned (.30 >= .5 * .32)
    run("grpo", "fp32", 0.2, 0.50), run("grpo", "fp32", 0.2, 0.54), run("grpo", "fp32", 0.2, 0.52),
    run("gspo", "fp32", 0.2, 0.48), run("gspo", "fp32", 0.2, 0.50), run("gspo", "fp32", 0.2, 0.52),
    # bf16: grpo collapses on 2 of 3 seeds (steps 12 and 18: median 15); gspo learns (.30 each)
    run("grpo", "bf16", 0.2, 0.05, 12), run("grpo", "bf16", 0.2, 0.04, 18), run("grpo", "bf16", 0.2, 0.5),
    run("gspo", "bf16", 0.2, 0.50), run("gspo", "bf16", 0.2, 0.50), run("gspo", "bf16", 0.2, 0.50),
    # stale4: grpo gains (.10, .12, .08) mean .10 < .5 * .30: slowed; gspo (.30, .32, .28) learned; 0.2 apart
    # with SE .0163: separated. One gspo seed collapsed (1 of 3: not the cell's outcome)
    run("grpo", "stale4", 0.2, 0.30), run("grpo", "stale4", 0.2, 0.32), run("grpo", "stale4", 0.2, 0.28),
    run("gspo", "stale4", 0.2, 0.50, 30), run("gspo", "stale4", 0.2, 0.52), run("gspo", "stale4", 0.2, 0.48),
]


def build(runs=RUNS, **kw):
    return stability_map(runs, method_of=lambda r: r["spec"]["method"], regime_of=lambda r: r["spec"]["regime"], **kw)


def test_cells_by_hand():
    smap = build()
    assert smap["methods"] == ["grpo", "gspo"] and smap["regimes"] == ["fp32", "bf16", "stale4"]
    outcome = {key: c["outcome"] for key, c in smap["cells"].items()}
    assert outcome == {("grpo", "fp32"): "learned", ("gspo", "fp32"): "learned", ("grpo", "bf16"): "collapsed",
                       ("gspo", "bf16"): "learned", ("grpo", "stale4"): "slowed", ("gspo", "stale4"): "learned"}
    assert smap["separated"] == {"fp32": False, "bf16": True, "stale4": True}
    c = smap["cells"][("grpo", "fp32")]
    assert c["gain"]["mean"] == pytest.approx(0.32) and c["gain"]["std"] == pytest.approx(0.02) and c["n"] == 3
    assert smap["cells"][("grpo", "bf16")]["text"] == "collapsed at step 15 (2/3 seeds)"
    assert smap["cells"][("gspo", "stale4")]["collapsed"] == 1
    assert smap["cells"][("grpo", "stale4")]["text"] == "+10.0 ± 2.0 pp"


def test_the_learned_share_moves_the_line_between_learned_and_slowed():
    # gspo/fp32 gains .30 of the best .32: learned at share .9 (>= .288), slowed at share .95 (< .304)
    assert build(learned_share=0.9)["cells"][("gspo", "fp32")]["outcome"] == "learned"
    assert build(learned_share=0.95)["cells"][("gspo", "fp32")]["outcome"] == "slowed"
    with pytest.raises(ValueError, match="learned_share"):
        build(learned_share=0.0)


def test_a_gain_below_the_floor_is_not_learning_even_alone_and_the_order_is_kept():
    # one method, gains (.02, .03, .04): the best of its regime, but under the 5-point floor: slowed
    runs = [run("grpo", "deep", 0.01, 0.01 + g) for g in (0.02, 0.03, 0.04)] + [run("gspo", "base", 0.2, 0.5)]
    smap = build(runs)
    assert smap["cells"][("grpo", "deep")]["outcome"] == "slowed" and smap["cells"][("gspo", "base")]["outcome"] == \
        "learned"
    assert build(runs, min_gain=0.02)["cells"][("grpo", "deep")]["outcome"] == "learned"
    ordered = build(runs, order=(["gspo", "grpo", "ppo"], ["base", "deep", "wide"]))
    assert ordered["methods"] == ["gspo", "grpo"] and ordered["regimes"] == ["base", "deep"]  # unrun ones left out
    assert build(runs)["regimes"] == ["deep", "base"]  # first seen


def test_a_regime_where_nothing_learns_has_no_learned_cell():
    runs = [run(m, "hard", 0.2, 0.2 - d) for m in ("grpo", "gspo") for d in (0.0, 0.01, 0.02)]
    smap = build(runs)
    assert {c["outcome"] for c in smap["cells"].values()} == {"slowed"} and smap["separated"] == {"hard": False}


def test_table_and_figure(tmp_path):
    table = map_table(build())
    assert table.splitlines()[0] == "| method | fp32 (nothing separates) | bf16 | stale4 |"
    assert "| grpo | learned: +32.0 ± 2.0 pp | collapsed: collapsed at step 15 (2/3 seeds) | slowed: +10.0 ± 2.0 pp |" \
        in table
    path = draw_map(build(), tmp_path / "map.png")
    assert path.stat().st_size > 5000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_precursor_by_hand():
    metrics = {"grad/norm": ([1, 2, 3, 4], [1.0, 2.0, 8.0, 50.0]), "entropy": ([1, 2, 3, 4], [1.0, 0.8, 0.3, 0.01])}
    assert precursor(metrics, 4) == {"grad/norm": (1.0, 8.0), "entropy": (1.0, 0.3)}  # no mismatch/kl logged
    assert precursor(metrics, 1) == {} and precursor(metrics, None) == {}


def test_details_table():
    runs = [dict(r, mismatch_kl=float("nan") if r["spec"]["regime"] != "bf16" else 1e-4 * (i % 3 + 1),
                 mismatch_ess=float("nan"), drift=0.1, clip=0.02) for i, r in enumerate(RUNS)]
    for r in runs:
        r["spec"] = {"method": r["spec"]["method"], "label": r["spec"]["regime"]}
    smap = stability_map(runs, method_of=lambda r: r["spec"]["method"], regime_of=lambda r: r["spec"]["label"])
    lines = details_table(runs, smap).splitlines()
    assert lines[0] == "| regime | method | outcome | final | mismatch/kl | ess | expert change/update | clipped |"
    assert len(lines) == 2 + 6
    # bf16 grpo: finals (.05, .04, .5) mean 19.7%; kl 1e-4 * (i % 3 + 1) for i = 6, 7, 8: (1, 2, 3)e-4
    assert lines[4] == "| bf16 | grpo | collapsed | 19.7 ± 26.3% | 0.0002 ± 0.0001 | – | 10.0 ± 0.0% | 2.0 ± 0.0% |"


def test_drift_per_layer_figure(tmp_path):
    runs = [{"spec": {"method": m, "label": label}, "drift_layers": dict(enumerate(d))}
            for m, label, d in (("grpo", "baseline", [0.01, 0.02]), ("grpo", "deep", [0.01, 0.02, 0.03, 0.05]),
                                ("gspo", "deep", [0.0] * 4))]
    path = draw_drift_per_layer(runs, tmp_path / "drift.png")
    assert path.stat().st_size > 5000
    assert draw_drift_per_layer([dict(r, drift_layers={}) for r in runs], tmp_path / "none.png") is None


def summary(label, method, objective, replay, acc, clip, drift, ratio_std, grad_spread):
    return {"spec": {"group": "regime", "label": label, "method": method, "objective": objective, "model": "moe",
                     "replay": replay, "layers": 4}, "acc_mean": acc, "acc_final": acc, "clip": clip, "drift": drift,
            "ratio_std": ratio_std, "grad_norm_rel_std": grad_spread, "collapse_step": None}


def test_claims_per_regime_read_only_the_plain_methods():
    from gspo.apps.lab.claims import plain_methods, regime_claims

    methods = {"grpo": {"objective": "grpo"}, "gspo": {"objective": "gspo"},
               "grpo_r2": {"objective": "grpo", "routing_replay": "old_policy"},
               "grpo_tis": {"objective": "grpo", "rollout_correction": "token_tis"}}
    assert plain_methods(methods) == {"grpo", "gspo", "grpo_r2"}
    runs = []
    for d in (-0.02, 0.0, 0.02):  # three seeds: means below, std .02 (SE of a difference .0163)
        runs += [summary("mismatch-bf16", "grpo", "grpo", "none", 0.32 + d, 0.001 + d / 100, 0.04, 0.30 + d, 0.5 + d),
                 summary("mismatch-bf16", "gspo", "gspo", "none", 0.52 + d, 0.15 + d, 0.04, 0.02 + d / 10, 0.5 + d),
                 summary("mismatch-bf16", "grpo_r2", "grpo", "old_policy", 0.52 + d, 0.001, 0.0, 0.30, 0.5),
                 # a corrected GRPO far above plain GRPO: were it read as GRPO, C1 and C4 would not reproduce
                 summary("mismatch-bf16", "grpo_tis", "grpo", "none", 0.90, 0.001, 0.04, 0.30, 0.5),
                 summary("baseline", "grpo", "grpo", "none", 0.40 + d, 0.001, 0.04, 0.30 + d, 0.5 + d),
                 summary("baseline", "gspo", "gspo", "none", 0.40 - d, 0.15, 0.04, 0.30 - d, 0.5 - d)]
    cfg = {"regimes": {"mismatch": {"bf16": {"sampler_dtype": "bfloat16"}}}, "regime_methods": methods}
    verdicts = {label: {c["claim"]: c["verdict"] for c in rows} for label, rows in regime_claims(runs, cfg).items()}
    # bf16: GSPO .52 vs GRPO .32 (diff .20 > 2 x .0163): C1 reproduced; clipping .15 vs .001: 150x, C2; drift 4%
    # with no depth sweep: C3 partly (1-5%); GRPO + replay and GSPO both above GRPO: C4; ratio std .02 vs .30 lower and
    # grad spread equal: C5
    assert verdicts["mismatch-bf16"] == {"C1": "reproduced", "C2": "reproduced", "C3": "partly", "C4": "reproduced",
                                "C5": "reproduced"}
    # baseline: equal means (.40 both): C1 not reproduced; no replay run: C4 n/a; ratio std equal: C5 not
    assert verdicts["baseline"]["C1"] == "not reproduced" and verdicts["baseline"]["C4"] == "n/a"
    # drift below 1% without a depth sweep: C3 not reproduced (the paper: ~10%)
    low = [{**r, "drift": 0.002} for r in runs]
    assert {c["claim"]: c["verdict"] for c in regime_claims(low, cfg)["baseline"]}["C3"] == "not reproduced"
    assert verdicts["baseline"]["C5"] == "not reproduced" and list(verdicts) == ["baseline", "mismatch-bf16"]
