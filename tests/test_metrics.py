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


def _documented_keys() -> set[str]:
    """The keys of docs/training.md's metrics reference table."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "training.md").read_text()
    section = doc.split("### Metrics reference", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {key for line in rows for key in re.findall(r"`([^`]+)`", line.split(" | ")[0])}


def test_every_key_a_run_logs_is_in_the_metrics_reference(tmp_path, monkeypatch):
    from conftest import FAST, FIXTURES, TINY_CONFIG

    from jaxrl_scale.config import load_config
    from jaxrl_scale.train import train

    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))  # retry_env: a multi-turn task
    runs = {
        "episodes": ["task.name=retry_env:make", "task.max_turns=2", "task.max_episode_tokens=16",
                     "warm_start.steps=0"],  # fmt: skip
        "mixture": ["task.name=mixture", "task.num_train=32", "pipeline.mode=sync",
                    "task.mixture=[{name: arithmetic, domain: a}, {name: arithmetic, domain: b}]",
                    "train.steps=5", "train.eval_every=1", "forecast.c_min_fraction=0"],
        "lora_packed": ["pipeline.mode=pipeline_rl", "model.lora.rank=4", "train.packing=true",
                        "log.rollouts=2"],
    }  # fmt: skip
    logged: set[str] = set()
    for name, overrides in runs.items():
        rows = train(load_config(TINY_CONFIG, [*FAST, "train.steps=2", *overrides]),
                     tmp_path / name)  # fmt: skip
        logged |= {key for row in rows for key in row}
    documented = _documented_keys()
    assert len(documented) > 60

    def is_documented(key: str) -> bool:
        if key in documented:
            return True
        if "/" in key:  # a named reward part, or a mixture domain's copy of a key
            base = key.split("/")[0]
            return base == "reward" or ("<key>/<domain>" in documented and is_documented(base))
        if key.startswith("eval_"):
            return "eval_<key>" in documented and key.removeprefix("eval_") in documented
        return False

    # What the runs must have logged for this check to bite: every kind of key.
    for key in ("episodes_out_of_turns", "eval_pass_rate/a", "forecast_status",
                "train_packed", "eval_env_errors"):  # fmt: skip
        assert key in logged, key
    missing = sorted(k for k in logged if not is_documented(k))
    assert not missing, f"logged but not in docs/training.md's metrics reference: {missing}"
    # log.rollouts: 2 samples per step, each its sequence with the train mask over it.
    samples = [json.loads(x) for x in (tmp_path / "lora_packed" / "rollouts.jsonl").open()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    for s in samples:
        n = len(s["tokens"])
        assert len(s["mask"]) == len(s["logp"]) == len(s["versions"]) == n
        first = s["mask"].index(1)  # the prompt: mask 0; then the completion, sampled
        assert set(s["mask"][:first]) == {0} and sum(s["mask"]) == n - first
        assert s["text"] and isinstance(s["advantage"], float)
