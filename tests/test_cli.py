import json

from jaxrl_scale.cli import main


def test_demo_runs_end_to_end(tmp_path):
    assert main(["demo", "--out", str(tmp_path), "--steps", "3"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["nll_last"] < summary["nll_first"]  # three AdamW steps at lr 3e-3 do move it
    assert summary["reload_max_abs_logit_diff"] == 0.0
    assert summary["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert (tmp_path / "model" / "config.json").exists()
    assert set(summary["greedy"]) == {"12+7=", "30+25=", "4+4="}


def test_bad_override_exits_2_naming_key(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--set", "model.num_layer=1"]) == 2
    assert "model.num_layers" in capsys.readouterr().err
