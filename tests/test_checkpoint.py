"""One RunState as one orbax item: round trip, resharded restore, pending batches, damage."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_scale.config import MeshConfig
from jaxrl_scale.parallel.sharding import make_mesh
from jaxrl_scale.rl.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatch,
    RunState,
    abstract_like,
)
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.rollout import Rollouts, rollouts_from_host, rollouts_to_host
from jaxrl_scale.rl.step import Batch, init_train_state


def _restore(run_dir, target, pending_from_host):
    ckpt = Checkpointer(run_dir)
    try:
        return ckpt.restore_latest(target, pending_from_host)
    finally:
        ckpt.close()


def _train_state(mesh):
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, PartitionSpec("data")))
    return init_train_state({"w": w}, optax.adam(1e-3))


def _rollouts(rows: int, prompt_len: int, seed: int) -> Rollouts:
    rng = np.random.default_rng(seed)
    shapes = Batch.shapes(rows, prompt_len, 3)
    batch = Batch(**{
        name: rng.normal(size=s.shape).astype(s.dtype)
        for name, s in vars(shapes).items()
        if s is not None  # routes: router replay only
    })  # fmt: skip
    curriculum = Curriculum(5, seed=seed)
    curriculum.update(curriculum.next_batch(2), [1.0, 0.0])
    return Rollouts(
        batch=batch,
        indices=np.arange(2),
        versions=np.full((rows, 3), seed, np.int32),
        stats={"gen_tokens": 12, "reward_mean": 0.25},
        curriculum=curriculum.state_dict(),
    )


def _run_state(mesh, step: int, pending) -> RunState:
    curriculum = Curriculum(5, seed=0)
    curriculum.update(curriculum.next_batch(3), [0.95, 0.5, 0.0])
    return RunState(
        step=step,
        train=_train_state(mesh),
        curriculum=curriculum.state_dict(),
        key=jax.random.key(7),
        totals={"compute_flops": 1.5e12, "tokens": 96, "dropped_batches": 1},
        pending=pending,
    )


def test_a_run_state_round_trips_as_one_item_and_reshards(tmp_path):
    four = make_mesh(MeshConfig(data=4), jax.devices()[:4])
    pending = [_rollouts(4, 8, seed=1), _rollouts(4, 16, seed=2)]  # different prompt lengths
    saved = _run_state(four, step=6, pending=pending)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(saved, rollouts_to_host)
    ckpt.close()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["6"]  # one item, no npz

    eight = make_mesh(MeshConfig(data=8))  # a different device count: resharded on restore
    target = abstract_like(_train_state(eight))
    restored = _restore(tmp_path, target, lambda tree: rollouts_from_host(tree))
    assert restored.step == 6 and restored.totals == saved.totals
    w = restored.train.params["w"]
    assert w.sharding.mesh.devices.size == 8
    np.testing.assert_array_equal(w, saved.train.params["w"])
    assert int(restored.train.step) == 0
    np.testing.assert_array_equal(jax.random.key_data(restored.key), jax.random.key_data(saved.key))
    for k, v in saved.curriculum.items():
        np.testing.assert_array_equal(restored.curriculum[k], v)
    assert len(restored.pending) == 2
    for got, want in zip(restored.pending, pending, strict=True):
        for name in vars(want.batch):
            np.testing.assert_array_equal(getattr(got.batch, name), getattr(want.batch, name))
        np.testing.assert_array_equal(got.versions, want.versions)
        assert got.stats == want.stats and isinstance(got.stats["gen_tokens"], int)
        np.testing.assert_array_equal(got.curriculum["retired"], want.curriculum["retired"])


def test_no_pending_batches_and_no_checkpoint(tmp_path):
    mesh = make_mesh(MeshConfig(data=1))
    target = abstract_like(_train_state(mesh))
    from_host = lambda tree: rollouts_from_host(tree)  # noqa: E731
    assert _restore(tmp_path, target, from_host) is None
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_run_state(mesh, step=2, pending=[]), rollouts_to_host)
    ckpt.close()
    assert _restore(tmp_path, target, from_host).pending == []


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    mesh = make_mesh(MeshConfig(data=1))
    ckpt = Checkpointer(tmp_path)
    for step in (2, 4):
        ckpt.save(_run_state(mesh, step=step, pending=[]), rollouts_to_host)
        ckpt.wait()
    ckpt.close()
    for f in (tmp_path / "checkpoints" / "4").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    target = abstract_like(_train_state(mesh))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = _restore(tmp_path, target, lambda tree: [])
    assert restored.step == 2
    assert any("checkpoint 4" in str(w.message) and "unreadable" in str(w.message) for w in caught)
    for f in (tmp_path / "checkpoints" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with warnings.catch_warnings():  # none readable: an error, not a fresh start
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"none of the checkpoints \[4, 2\]"):
            _restore(tmp_path, target, lambda tree: [])


def test_a_checkpoint_of_another_model_is_refused_by_name_not_skipped(tmp_path):
    """Skipping it would start the run over and overwrite its metrics: an error instead."""
    mesh = make_mesh(MeshConfig(data=1))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_run_state(mesh, step=1, pending=[]), rollouts_to_host)
    ckpt.close()
    other = init_train_state({"w": jnp.zeros((3, 3))}, optax.adam(1e-3))
    with pytest.raises(CheckpointMismatch, match=r"params/w: \(8, 4\) in the checkpoint, \(3, 3\)"):
        _restore(tmp_path, abstract_like(other), lambda t: [])


def test_waiting_batches_keep_their_recorded_experts_for_a_replaying_run():
    import dataclasses

    from jaxrl_scale.config import ConfigError

    ro = _rollouts(4, 5, seed=1)
    routes = np.random.default_rng(0).integers(0, 8, (4, 5 + 3, 2, 2)).astype(np.uint8)
    replayed = dataclasses.replace(ro, batch=dataclasses.replace(ro.batch, routes=routes))
    tree = rollouts_to_host([replayed])
    back = rollouts_from_host(tree, router_replay=True)[0].batch
    np.testing.assert_array_equal(back.routes, routes)
    with pytest.warns(UserWarning, match="1 waiting batches .*router_replay is off"):
        assert rollouts_from_host(tree)[0].batch.routes is None  # routes afresh
    plain = rollouts_to_host([ro])
    assert "routes" not in plain["0"]["batch"]
    with pytest.raises(ConfigError, match="model.router_replay: .* without recording"):
        rollouts_from_host(plain, router_replay=True)
