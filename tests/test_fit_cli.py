import json
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_scale.cli import main
from jaxrl_scale.fit import sigmoid

C = np.geomspace(300, 30000, 30)


def _run_dir(tmp_path, name, a, b, seed):
    run = tmp_path / name
    run.mkdir()
    rng = np.random.default_rng(seed)
    with (run / "metrics.jsonl").open("w") as f:
        for i, c in enumerate(C):
            y = float(sigmoid(c, a, b, 2500.0, 0.3)) + 0.004 * rng.standard_normal()
            f.write(json.dumps({"step": i, "compute_flops": c, "eval_pass_rate": y}) + "\n")
    return run


def test_fit_cli_json_table_and_plot(tmp_path, capsys):
    runs = [_run_dir(tmp_path, "cispo", 0.61, 2.0, 0), _run_dir(tmp_path, "dapo", 0.61, 1.6, 1)]
    png = tmp_path / "fit.png"
    args = [*map(str, runs), "--predict-at", "1e5", "--bootstrap", "300", "--plot", str(png)]
    assert main(["fit", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in report["runs"]] == ["cispo", "dapo"]
    for r in report["runs"]:
        assert r["a_ci"][0] <= 0.61 <= r["a_ci"][1]
        assert r["converged"] and r["identifiable"]
        assert r["predicted_ci"][0] <= r["predicted"] <= r["predicted_ci"][1]
    assert report["shared_ceiling"][0]["more_efficient"] == "cispo"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["fit", *args, "--fit-until", "0.5"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:2] == ["run", "A"]
    assert "last point: actual / predicted" in table
    assert "cispo is more compute-efficient" in table


def test_fit_cli_bad_input_exits_2_with_message(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("compute_flops,eval_pass_rate\n1,0.1\n2,0.2\n3,nan\n4,0.3\n5,0.3\n")
    assert main(["fit", str(bad)]) == 2
    assert "reward[2] is nan" in capsys.readouterr().err


def test_fit_cli_warns_about_repairs(tmp_path, capsys):
    f = tmp_path / "dupes.csv"
    rows = [(c, float(sigmoid(c, 0.6, 2.0, 2500.0, 0.3))) for c in C] + [(C[3], 0.31)]
    f.write_text("compute_flops,eval_pass_rate\n" + "".join(f"{c},{r}\n" for c, r in rows))
    assert main(["fit", str(f), "--bootstrap", "200"]) == 0
    err = capsys.readouterr().err
    assert "not sorted" in err and "averaged" in err


def test_importing_the_fitter_does_not_show_jaxopt_deprecation():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import jaxrl_scale.fit\n"
        "print(sum('JAXopt' in str(x.message) for x in w))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


@pytest.mark.parametrize("argv", [["fit"], ["fit", "x.csv", "--bootstrap", "ten"]])
def test_fit_cli_usage_errors(argv):
    with pytest.raises(SystemExit):
        main(argv)


def test_fit_cli_on_a_run_directory_holds_r0_at_the_step_0_eval(tmp_path, capsys):
    """A run's metrics.jsonl starts with the eval before RL at compute 0: that is R0, not a
    point (compute must be > 0 on a log axis)."""
    compute = np.geomspace(1e11, 1e13, 10)
    rows = [{"step": 0, "compute_flops": 0.0, "eval_pass_rate": 0.31}]
    rows += [{"step": 1, "compute_flops": 5e10, "loss": 0.2}]  # a training row: skipped
    rows += [
        {"step": 10 * (i + 1), "compute_flops": c, "eval_pass_rate": float(r)}
        for i, (c, r) in enumerate(
            zip(compute, sigmoid(compute, 0.8, 1.5, 1e12, 0.31), strict=True)
        )
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["fit", str(run), "--json", "--bootstrap", "100"]) == 0
    entry = json.loads(capsys.readouterr().out)["runs"][0]
    assert entry["r0"] == pytest.approx(0.31)  # held exactly
    assert entry["points"] == 10
    assert entry["a"] == pytest.approx(0.8, abs=1e-3)
    assert main(["fit", str(run), "--json", "--bootstrap", "100", "--r0", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["r0"] == pytest.approx(0.2)


def test_fit_cli_c_min_fraction_leaves_out_early_points(tmp_path, capsys):
    run = _run_dir(tmp_path, "cispo", 0.61, 2.0, 0)
    base = [str(run), "--bootstrap", "200", "--json"]
    assert main(["fit", *base, "--c-min-fraction", "0"]) == 0
    everything = json.loads(capsys.readouterr().out)["runs"][0]
    assert main(["fit", *base, "--c-min-fraction", "0.1"]) == 0
    out = capsys.readouterr()
    late = json.loads(out.out)["runs"][0]
    # C is geometric from 300 to 30000: 0.1 x 30000 = 3000 leaves out the points below it.
    assert everything["points"] == C.size
    assert late["points"] == int(np.sum(C >= 3000.0)) < C.size
    assert "left out" in out.err


def test_a_fit_that_did_not_converge_is_neither_ranked_nor_compared(tmp_path, capsys):
    good = _run_dir(tmp_path, "good", 0.61, 2.0, 0)
    noisy = tmp_path / "noisy"  # four evaluations that no sigmoid follows
    noisy.mkdir()
    rows = zip(C[::8], [0.3, 0.7, 0.25, 0.65], strict=True)
    (noisy / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "compute_flops": c, "eval_pass_rate": y}) + "\n"
        for i, (c, y) in enumerate(rows)
    ))  # fmt: skip
    args = [str(good), str(noisy), "--bootstrap", "200"]
    assert main(["fit", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    entry = report["runs"][1]
    assert not (entry["converged"] and np.isfinite(entry["a_ci"]).all())
    assert report["ranking"] == ["good"] and report["not_converged"] == ["noisy"]
    assert report["shared_ceiling"] == []
    assert any("train.eval_every" in w for w in entry["warnings"])
    assert main(["fit", *args]) == 0
    assert "not converged, not ranked: noisy" in capsys.readouterr().out
