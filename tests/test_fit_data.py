import json

import numpy as np
import pytest

from jaxrl_scale.fit import CurveDataError, CurveDataWarning, clean_curve, fit_sigmoid, load_curve

C = np.array([100.0, 200.0, 400.0, 800.0, 1600.0])
R = np.array([0.30, 0.35, 0.45, 0.55, 0.60])


@pytest.mark.parametrize(
    "compute, reward, match",
    [
        (C[:3], R[:3], "3 distinct points; a sigmoid fit needs at least 4"),
        (C, np.array([0.3, np.nan, 0.4, 0.5, 0.6]), r"reward\[1\] is nan"),
        (np.array([100, np.inf, 300, 400, 500.0]), R, r"compute\[1\] is inf"),
        (np.array([0, 200, 400, 800, 1600.0]), R, r"compute\[0\] = 0.0 \(compute must be > 0\)"),
        (C, np.array([0.3, 0.35, 1.2, 0.5, 0.6]), r"reward\[2\] = 1.2 is outside \[0, 1.0\]"),
        (C, R[:4], "one length|share one shape"),
    ],
)
def test_bad_input_is_named(compute, reward, match):
    with pytest.raises(CurveDataError, match=match):
        clean_curve(compute, reward)
    with pytest.raises(CurveDataError, match=match):
        fit_sigmoid(compute, reward)


def test_unsorted_points_are_sorted_with_a_warning():
    order = np.array([3, 0, 4, 1, 2])
    with pytest.warns(CurveDataWarning, match="not sorted"):
        curve = clean_curve(C[order], R[order])
    np.testing.assert_array_equal(curve.compute, C)
    np.testing.assert_array_equal(curve.reward, R)


def test_duplicate_compute_values_are_averaged_with_a_warning():
    c = np.array([100.0, 200.0, 200.0, 400.0, 800.0, 1600.0])
    r = np.array([0.30, 0.34, 0.36, 0.45, 0.55, 0.60])
    with pytest.warns(CurveDataWarning, match="1 compute values appear more than once"):
        curve = clean_curve(c, r)
    np.testing.assert_allclose(curve.compute, C)
    np.testing.assert_allclose(curve.reward, R)  # (0.34 + 0.36) / 2 = 0.35


def test_c_min_drops_early_points_and_says_so():
    with pytest.warns(CurveDataWarning, match="dropped 1 points with compute < 90"):
        curve = clean_curve(np.append(50.0, C), np.append(0.1, R), c_min=90.0)
    np.testing.assert_array_equal(curve.compute, C)


def test_other_metric_ranges_with_a_max():
    assert clean_curve(C, R * 10, a_max=10.0).reward.max() == pytest.approx(6.0)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_load_run_directory_jsonl_and_csv(tmp_path):
    run = tmp_path / "run_a"
    run.mkdir()
    rows = []
    for i, (c, r) in enumerate(zip(C, R, strict=True)):
        rows.append({"step": 2 * i, "compute_flops": c, "eval_pass_rate": r})
        rows.append({"step": 2 * i + 1, "compute_flops": c + 1})  # no eval on this step
    _write_jsonl(run / "metrics.jsonl", rows)
    curve = load_curve(run)
    assert curve.name == "run_a"
    np.testing.assert_array_equal(curve.compute, C)
    csv = tmp_path / "b.csv"
    csv.write_text("gpu_hours,score\n" + "".join(f"{c},{r}\n" for c, r in zip(C, R, strict=True)))
    curve = load_curve(csv, x="gpu_hours", y="score")
    np.testing.assert_array_equal(curve.reward, R)


def test_file_errors_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"compute_flops": 1, "eval_pass_rate": 0.1}\n{oops\n')
    with pytest.raises(CurveDataError, match=r"bad\.jsonl:2: not valid JSON"):
        load_curve(bad)
    csv = tmp_path / "c.csv"
    csv.write_text("x,y\n1,0.1\n2,abc\n")
    with pytest.raises(CurveDataError, match=r"c\.csv:3: y: expected a number, got 'abc'"):
        load_curve(csv, x="x", y="y")
    with pytest.raises(CurveDataError, match=r"no column 'reward' \(columns: x, y\)"):
        load_curve(csv, x="x", y="reward")
    with pytest.raises(CurveDataError, match="no such file"):
        load_curve(tmp_path / "missing.jsonl")


def test_a_sampling_sd_column_on_some_evals_only_is_not_used_and_says_so():
    from jaxrl_scale.fit.data import curve_from_rows

    rows = [
        {"compute_flops": float(c), "eval_pass_rate": 0.3 + 0.05 * c, "eval_sampling_sd": 0.01}
        for c in range(5)
    ]
    full = curve_from_rows(rows)
    assert full.sd is not None and full.r0_sd == pytest.approx(0.01)
    del rows[2]["eval_sampling_sd"]
    with pytest.warns(CurveDataWarning, match="eval_sampling_sd is given for 4 of 5 evals"):
        partial = curve_from_rows(rows)
    assert partial.sd is None
