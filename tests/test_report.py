"""Tests for gspo.report: loading, summarising and plotting a synthetic metrics.jsonl."""

import subprocess
import sys

import pytest

from gspo.report import GROUPS, _plot_group, load_metrics, moving_average, plot_run, summarize

# Written by hand: nulls (step 1 loss, all of entropy), a metric that starts late (eval),
# one that stops early (clip), and no ratio/completion/grad/groups metrics at all.
LINES = [
    '{"step": 0, "reward/mean": 0.0, "reward/std": 1.0, "loss/policy": 2.0, "clip/high_frac": 0.5, "entropy": null}',
    '{"step": 1, "reward/mean": 0.5, "reward/std": 0.5, "loss/policy": null, "clip/high_frac": 0.25, "entropy": null}',
    '{"step": 2, "reward/mean": 1.0, "reward/std": 0.0, "loss/policy": -1.0, "eval/accuracy": 0.75}',
    '{"step": 3, "reward/mean": 0.25, "loss/policy": 4.0, "moe/expert_change_frac": 0.125, '
    '"moe/expert_change_frac/layer_0": 0.0625}',
]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(LINES) + "\n")
    return tmp_path


def test_load_metrics_exact(run_dir):
    expected = {
        "reward/mean": ([0, 1, 2, 3], [0.0, 0.5, 1.0, 0.25]),
        "reward/std": ([0, 1, 2], [1.0, 0.5, 0.0]),
        "loss/policy": ([0, 2, 3], [2.0, -1.0, 4.0]),  # step 1 was null
        "clip/high_frac": ([0, 1], [0.5, 0.25]),
        "eval/accuracy": ([2], [0.75]),
        "moe/expert_change_frac": ([3], [0.125]),
        "moe/expert_change_frac/layer_0": ([3], [0.0625]),
    }  # entropy never had a value: absent
    assert load_metrics(run_dir) == expected
    assert load_metrics(run_dir / "metrics.jsonl") == expected  # the file itself works too


def test_load_metrics_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        load_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"reward/mean": 1.0}\n')
    with pytest.raises(ValueError, match=r"record 1 has no integer 'step'"):
        load_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": "high"}\n')
    with pytest.raises(ValueError, match=r"record 2: metric 'x' is not a number"):
        load_metrics(tmp_path)


def test_summarize_hand_checked(run_dir):
    s = summarize(run_dir)
    assert s["reward/mean"] == {"first": 0.0, "last": 0.25, "min": 0.0, "max": 1.0, "n": 4, "nonfinite": 0}
    assert s["loss/policy"] == {"first": 2.0, "last": 4.0, "min": -1.0, "max": 4.0, "n": 3, "nonfinite": 1}
    assert s["reward/std"] == {"first": 1.0, "last": 0.0, "min": 0.0, "max": 1.0, "n": 3, "nonfinite": 0}
    assert s["eval/accuracy"] == {"first": 0.75, "last": 0.75, "min": 0.75, "max": 0.75, "n": 1, "nonfinite": 0}
    # Only ever null: reported, with its count, rather than silently dropped.
    assert s["entropy"] == {"first": None, "last": None, "min": None, "max": None, "n": 0, "nonfinite": 2}
    assert set(s) == {"reward/mean", "reward/std", "loss/policy", "clip/high_frac", "entropy",
                      "eval/accuracy", "moe/expert_change_frac", "moe/expert_change_frac/layer_0"}


def test_plot_run_writes_exactly_the_present_groups(run_dir):
    import matplotlib.image

    paths = plot_run(run_dir)
    # GROUPS order; entropy (all null), ratio, completion, grad, groups have no data.
    names = ["reward.png", "eval.png", "clip.png", "loss.png", "moe.png"]
    assert paths == [run_dir / "plots" / n for n in names]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(names)
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        img = matplotlib.image.imread(path)
        assert img.shape == (450, 800, 4)  # FIGSIZE 8 x 4.5 in at 100 dpi
        assert img[..., :3].std() > 0.01  # not a blank canvas


def test_plot_run_out_dir_and_full_set(tmp_path):
    # Every group present once: one file per group, written where asked.
    names = ["reward/mean", "eval/accuracy", "groups/zero_std_frac", "clip/low_frac", "ratio/max",
             "completion/mean_len", "entropy", "loss/kl", "grad/norm", "moe/expert_change_frac"]
    body = "".join(f'{{"step": {s}, ' + ", ".join(f'"{n}": {s * 0.5}' for n in names) + "}\n" for s in range(3))
    (tmp_path / "metrics.jsonl").write_text(body)
    out = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out_dir=out, smooth=0)
    assert paths == [out / g.filename for g in GROUPS]
    assert len(paths) == 10 and not (tmp_path / "plots").exists()
    with pytest.raises(ValueError, match="smooth must be None or an int >= 0"):
        plot_run(tmp_path, smooth=-1)


def test_moving_average_hand_values():
    assert moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([3, 0, 3, 6], 3) == [3.0, 1.5, 2.0, 3.0]
    assert moving_average([5.0], 1) == [5.0]
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        moving_average([1.0], 0)


def test_smoothing_draws_faint_raw_line_under_average():
    from matplotlib.figure import Figure

    steps = list(range(10))
    values = [float(v % 2) for v in steps]  # 0, 1, 0, 1, ...
    reward = next(g for g in GROUPS if g.filename == "reward.png")
    ax = Figure().add_subplot()
    _plot_group(ax, reward, {"reward/fmt": (steps, values)}, smooth=2)
    raw, smoothed = ax.lines
    assert list(raw.get_ydata()) == values and raw.get_alpha() == 0.25
    assert list(smoothed.get_ydata()) == [0.0] + [0.5] * 9
    assert smoothed.get_label() == "reward/fmt" and raw.get_color() == smoothed.get_color()
    assert ax.get_xlabel() == "step" and ax.get_title() == "Reward"

    ax = Figure().add_subplot()
    _plot_group(ax, reward, {"reward/fmt": (steps, values)}, smooth=0)
    assert len(ax.lines) == 1


def test_reward_band_spans_mean_plus_minus_std(run_dir):
    from matplotlib.figure import Figure

    reward = next(g for g in GROUPS if g.filename == "reward.png")
    ax = Figure().add_subplot()
    _plot_group(ax, reward, {k: v for k, v in load_metrics(run_dir).items() if k.startswith("reward")}, smooth=0)
    (band,) = ax.collections
    ymin, ymax = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    # Steps 0..2 (std present): mean - std = -1, 0, 1; mean + std = 1, 1, 1.
    assert (ymin, ymax) == (-1.0, 1.0)
    assert [line.get_label() for line in ax.lines] == ["reward/mean"]  # std is the band, not a line


@pytest.mark.slow
def test_plotting_leaves_pyplot_alone(run_dir):
    code = (
        "import sys, matplotlib; from gspo.report import plot_run; "
        f"plot_run({str(run_dir)!r}); "
        "print('matplotlib.pyplot' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_matplotlib_plot_run_names_the_fix_and_plot_run_or_skip_says_it_skipped(run_dir):
    code = (
        "import sys; sys.modules['matplotlib'] = None  # as if it were not installed\n"
        "from gspo.report import PlotsUnavailable, plot_run, plot_run_or_skip\n"
        "try:\n"
        f"    plot_run({str(run_dir)!r})\n"
        "except PlotsUnavailable as err:\n"
        "    print(err)\n"
        f"print(plot_run_or_skip({str(run_dir)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["plots need matplotlib, which is not installed: pip install 'gspo[lab]'",
                                        "[]"], done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"plots skipped: matplotlib is not installed; pip install 'gspo[lab]', then "
                                        f"`gspo plot {run_dir}` draws them"]
    assert not (run_dir / "plots").exists()

