"""`jaxrl-scale memory`: compiled from shapes on the fake 8-device CPU mesh, checked against
concrete arrays and against what the settings it names should do."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_scale import sharding
from jaxrl_scale.cli import main
from jaxrl_scale.config import load_config
from jaxrl_scale.memory import plan, train_step_memory
from jaxrl_scale.model import Policy

TINY = "configs/tiny_arithmetic.yaml"
# A longer completion than the demo's, so activations are the biggest term.
LONG = ["sampler.max_new_tokens=64", "train.prompts_per_step=8", "train.group_size=8"]


def test_json_reports_both_programs_and_the_parameters_match_real_shards(capsys):
    overrides = ["mesh.data=1", "mesh.fsdp=8", *LONG]
    assert (
        main(["memory", "--config", TINY, "--json", *sum((["--set", o] for o in overrides), [])])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    cfg = load_config(TINY, overrides)
    assert report["sequence_length"] == report["prompt_len"] + 64
    for name in ("train_step", "generate"):
        assert report[name]["per_device_bytes"] > report[name]["arguments_bytes"] > 0
    # Independently: the bytes of one device's shard of every parameter, from real arrays.
    mesh, _ = sharding.make_meshes(cfg)
    model = sharding.init_sharded(lambda: Policy(cfg.model, rngs=nnx.Rngs(params=0)), mesh)
    real = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert report["train_step"]["parameters_bytes"] == real
    assert report["train_step"]["optimizer_state_bytes"] >= 2 * real  # Adam's two moments
    assert report["train_step"]["arguments_bytes"] >= 3 * real


def test_a_config_that_does_not_fit_exits_1_and_names_the_biggest_term(capsys):
    args = ["memory", "--config", TINY, "--set", "mesh.data=-1", "--device-memory", "0.0001"]
    assert main(args + [f"--set={o}" for o in LONG]) == 1
    out = capsys.readouterr().out
    assert "fits in 0.1 MiB: NO" in out
    assert "temporaries (activations and gradients" in out and "train.micro_batches" in out


def _temporaries(overrides):
    cfg = load_config(TINY, [*LONG, *overrides])
    mesh, _ = sharding.make_meshes(cfg)
    return train_step_memory(cfg, mesh, 8)["temporaries_bytes"]


def test_the_named_knobs_shrink_the_train_step():
    base = ["mesh.data=1", "model.num_layers=4"]
    assert _temporaries([*base, "train.micro_batches=4"]) < 0.6 * _temporaries(base)
    scanned = [*base, "model.num_layers=8", "model.hidden_size=256", "model.scan_layers=true"]
    assert _temporaries([*scanned, "model.remat=full"]) < 0.5 * _temporaries(scanned)


def test_micro_batches_keep_their_rows_split_over_the_devices():
    """Each micro-batch's rows stay split over the batch axes: eight devices hold about an
    eighth of one device's activations (every device running every row would hold all)."""
    micro = "train.micro_batches=4"
    one = _temporaries(["mesh.data=1", micro])
    eight = _temporaries(["mesh.data=8", micro])
    assert eight < 0.3 * one, (eight, one)


def test_plan_rejects_a_bad_prompt_length():
    with pytest.raises(ValueError, match="prompt length must be >= 1"):
        plan(load_config(TINY, ["mesh.data=1"]), prompt_len=0)


def test_procedural_prompt_length_is_measured():
    report = plan(load_config(TINY, ["mesh.data=1"]))
    assert report["prompt_len"] % 8 == 0 and 0 < report["prompt_len"] <= 16
    assert "arithmetic prompts" in report["prompt_len_from"]
    assert np.isfinite(report["train_step"]["per_device_bytes"])
