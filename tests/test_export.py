"""`jaxrl-scale export`: a run's checkpoint as a Hugging Face folder, read from the run's
config.yaml, tokenizer/ and checkpoint alone (no task, no curriculum, no sandbox), never
writing into the run; and a run's config.yaml rerunning from any directory."""

import hashlib
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import FAST, TINY_CONFIG

from jaxrl_scale.cli import main
from jaxrl_scale.config import load_config, resolve_paths
from jaxrl_scale.models import lora
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.tasks import make_task
from jaxrl_scale.train import setup, train


def _snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under `folder`: content hash, mtime and mode."""
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
            p.stat().st_mode,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class Arithmetic:
    """A notebook's task object: the built-in arithmetic problems, scored by their own rule."""

    def __init__(self):
        inner = make_task(load_config(TINY_CONFIG, FAST).task, seed=0)
        self.tokenizer = inner.tokenizer
        self.train_examples, self.eval_examples = inner.train_examples, inner.eval_examples
        self._inner = inner

    def score(self, completion, example):
        return self._inner.score(completion, example)


@pytest.fixture(scope="module")
def object_run(tmp_path_factory):
    """A run trained with `train(cfg, out, task=obj)` (its config.yaml cannot rebuild the
    task), and the logits of its newest checkpoint, read by a resume (the full restore)."""
    out = tmp_path_factory.mktemp("object_run")
    overrides = [*FAST, "pipeline.mode=sync", "train.steps=2", "checkpoint.every=2",
                 "warm_start.steps=0"]  # fmt: skip
    obj = Arithmetic()
    train(load_config(TINY_CONFIG, overrides), out, task=obj)
    run = setup(load_config(TINY_CONFIG, overrides), out, task=obj)
    assert run.resumed and run.start.step == 2
    model = lora.merge_policy(run.worker.graphdef, run.start.train.params, run.frozen)
    tokens = jnp.arange(24).reshape(2, 12) % run.cfg.model.vocab_size
    logits = np.asarray(model(tokens))
    run.checkpointer.close()
    return out, tokens, logits


def test_export_of_a_task_object_run_leaves_the_run_untouched(object_run, tmp_path):
    out, tokens, logits = object_run
    before = _snapshot(out)
    header = (out / "config.yaml").read_text().splitlines()[:3]
    assert any("a Python object (Arithmetic)" in line for line in header)
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    assert _snapshot(out) == before  # nothing written, rewritten or touched in the run
    model, tok = load_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(model(tokens)), logits, atol=1e-5)
    # The run's tokenizer came along (the built-in character tokenizer of the task).
    assert tok.decode(tok.encode("12+7=")) == "12+7="
    for file in (tmp_path / "hf").iterdir():  # readable by the group, as the rest
        assert file.stat().st_mode & 0o777 == 0o644, file.name


@pytest.mark.parametrize(
    "task",
    [
        # An import path whose module is importable nowhere, with a data file that is gone.
        {"name": "nowhere_to_be_found:make", "args": {"data": "/gone/qa.jsonl"}},
        # A code task whose problems file is gone: building it would start a sandbox.
        {"name": "code", "code": {"data": "/gone/problems.jsonl"}},
    ],
    ids=["import_path", "code"],
)
def test_export_never_builds_the_task(object_run, tmp_path, task):
    out, tokens, logits = object_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["task"].update(task)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    before = _snapshot(run)
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert _snapshot(run) == before
    model, _ = load_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(model(tokens)), logits, atol=1e-5)


def test_export_refuses_to_write_into_the_run_and_names_what_is_missing(
    object_run, tmp_path, capsys
):
    out, _, _ = object_run
    before = _snapshot(out)
    assert main(["export", str(out), "--out", str(out / "hf")]) == 2
    assert "inside the run directory" in capsys.readouterr().err
    assert _snapshot(out) == before and not (out / "hf").exists()
    empty = tmp_path / "empty"
    shutil.copytree(out, empty, ignore=shutil.ignore_patterns("checkpoints"))
    assert main(["export", str(empty), "--out", str(tmp_path / "hf")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (empty / "checkpoints").exists()  # not even an empty folder left behind
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_relative_paths_in_a_config_are_stored_resolved(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "qa.jsonl").write_text("{}\n")
    (tmp_path / "problems.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        TINY_CONFIG,
        [
            "task.name=my_rewards:make",
            "task.args.data=data/qa.jsonl",
            "task.args.files=[data/qa.jsonl, data]",
            "task.args.n_eval=8",
            "task.args.split=train",  # not a file here: stays a word
            "task.code.data=problems.jsonl",
            "task.math.data=openai/gsm8k",  # a Hugging Face dataset name, not a file
        ],
    )
    resolved = resolve_paths(cfg)
    qa = str(tmp_path / "data" / "qa.jsonl")
    assert resolved.task.args["data"] == qa
    assert resolved.task.args["files"] == [qa, str(tmp_path / "data")]
    assert resolved.task.args["n_eval"] == 8 and resolved.task.args["split"] == "train"
    assert resolved.task.code.data == str(tmp_path / "problems.jsonl")
    assert resolved.task.math.data == "openai/gsm8k"
    assert resolve_paths(resolved) == resolved  # absolute paths stay as they are
