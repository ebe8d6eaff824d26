"""The metrics writer: metrics.jsonl rows, TensorBoard scalars, truncation on resume."""

import json

import numpy as np

from jaxrl_scale.rl.metrics import MetricsWriter, read_metrics


def test_rows_are_plain_json_one_per_line_and_go_to_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 0, "eval_pass_rate": np.float32(0.5), "tokens": np.int64(3)})
    writer.write({"step": 1, "loss": float("nan"), "note": "text", "ok": True})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 0, "eval_pass_rate": 0.5, "tokens": 3},
        {"step": 1, "loss": None, "note": "text", "ok": True},  # JSON has no NaN
    ]
    events = list((tmp_path / "tensorboard").glob("events*"))
    assert events and events[0].stat().st_size > 0


def test_resume_keeps_rows_up_to_the_checkpoint_and_a_fresh_run_starts_empty(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(6):
        writer.write({"step": step})
    writer.close()
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)
    resumed.write({"step": 4, "again": True})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    assert read_metrics(tmp_path)[-1]["again"]
    MetricsWriter(tmp_path, tensorboard=False).close()
    assert read_metrics(tmp_path) == []


def test_a_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(tmp_path / "run", enabled=False)  # another process's
    writer.write({"step": 0})
    writer.close()
    assert not (tmp_path / "run").exists()
