import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import FAST, TINY_CONFIG

import jaxrl_scale
from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.generation.sampler import Sampling
from jaxrl_scale.rl.metrics import read_metrics
from jaxrl_scale.train import setup, train, train_run

TINY = TINY_CONFIG
TIMING = {"device_seconds", "gen_seconds", "score_seconds", "trainer_idle_fraction", "tokens_per_s"}


def _cfg(*extra):
    return load_config(TINY, [*FAST, *extra])


def _params(run_dir, *extra):
    run = setup(_cfg(*extra), run_dir)  # resumes from the run's last checkpoint
    return [np.asarray(x) for x in jax.tree.leaves(run.start.train.params)]


@pytest.mark.parametrize("loss", ["cispo", "dapo", "gspo", "grpo", "grpo,loss.kl_coef=0.1"])
def test_every_loss_kind_trains_in_sync_mode(loss, tmp_path):
    kind, *extra = loss.split(",")
    rows = train(_cfg(f"loss.kind={kind}", "pipeline.mode=sync", *extra), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for before, r in zip(rows[:-1], rows[1:], strict=True):
        assert np.isfinite(r["loss"]) and r["skipped"] == 0
        assert r["staleness_max"] == 0
        assert r["compute_flops"] > 0
        assert r["tokens_per_s"] > 0 and 0 <= r["trainer_idle_fraction"] <= 1
        # The step's generated tokens: every row's length summed; `tokens` is their running total.
        assert isinstance(r["gen_tokens"], int) and r["gen_tokens"] > 0
        assert r["gen_tokens"] == round(r["gen_length_mean"] * 4 * 4)  # FAST: 4 prompts x 4
        assert r["tokens"] - before["tokens"] == r["gen_tokens"]
    assert (
        "eval_pass_rate" in rows[0] and "eval_pass_rate" in rows[2] and "eval_pass_rate" in rows[3]
    )
    assert rows[3]["compute_flops"] > rows[1]["compute_flops"]
    logged = read_metrics(tmp_path)
    assert [r.get("gen_tokens") for r in logged] == [None] + [r["gen_tokens"] for r in rows[1:]]
    assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
    if extra:  # the KL reference is the warm-started policy and survives a restart
        assert rows[1]["kl_ref"] == 0.0
        resumed = setup(_cfg(f"loss.kind={kind}", "pipeline.mode=sync", *extra), tmp_path)
        assert resumed.start.step == 3 and resumed.start.train.ref_params is not None


@pytest.mark.parametrize("mode", ["pipeline_rl", "ppo_off_policy"])
def test_off_policy_modes_respect_the_staleness_bound(mode, tmp_path):
    rows = train(
        _cfg(f"pipeline.mode={mode}", "pipeline.max_staleness=2", "train.steps=5"), tmp_path
    )
    assert [r["step"] for r in rows] == list(range(6))
    assert max(r["staleness_max"] for r in rows) <= 2
    if mode == "ppo_off_policy":  # two batches per policy: staleness 0, 1, 0, 1, ...
        assert [r["staleness_max"] for r in rows[1:]] == [0, 1, 0, 1, 0]
    # `mismatch` mixes policy lag with sampler/trainer numerics; where no token is stale the
    # row also carries it as the numerics alone, and nowhere else.
    for r in rows[1:]:
        fresh = r["staleness_max"] == 0
        assert ("mismatch_numeric" in r) is fresh, r
        assert not fresh or (r["mismatch_numeric"], r["mismatch_numeric_max"]) == (
            r["mismatch"], r["mismatch_max"])  # fmt: skip
    assert any(r["staleness_max"] > 0 for r in rows[1:])
    # What ran, in the log: pipeline_rl decodes on the slot engine (sampler.batching auto),
    # ppo_off_policy in static waves; k as given; no generator jobs, no generator_processes.
    logged = read_metrics(tmp_path)[1:]
    batching = "continuous" if mode == "pipeline_rl" else "static"
    assert [(r["gen_batching"], r["staleness_bound"]) for r in logged] == [(batching, 2)] * 5
    assert not any("generator_processes" in r or "gen_engine" in r for r in logged)


def test_sync_runs_with_one_seed_are_identical(tmp_path):
    a = train(_cfg("pipeline.mode=sync"), tmp_path / "a")
    b = train(_cfg("pipeline.mode=sync"), tmp_path / "b")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)
    for x, y in zip(_params(tmp_path / "a"), _params(tmp_path / "b"), strict=True):
        np.testing.assert_array_equal(x, y)


class _SlowWorker:
    """A rollout worker whose batches take 0.5 s longer (delegates everything else): two such
    batches outlast the trainer's first step, which traces its program (about 0.4 s here), so
    the generator cannot get two versions ahead while it does."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def rollouts(self, params_for_chunk, key, **kw):
        time.sleep(0.5)
        return self.worker.rollouts(params_for_chunk, key, **kw)


@pytest.mark.parametrize("slow", ["trainer", "generator", "generator,static"])
def test_pipeline_with_a_slow_side_stays_within_k_and_finishes(slow, tmp_path, capsys):
    batching = "static" if "static" in slow else "continuous"
    cfg = _cfg("pipeline.mode=pipeline_rl", "pipeline.max_staleness=2", "train.steps=6",
               f"sampler.batching={batching}")  # fmt: skip
    run = setup(cfg, tmp_path)
    if slow == "trainer":
        step = run.train_step

        def slow_step(state, batch):
            time.sleep(0.2)
            return step(state, batch)

        run = dataclasses.replace(run, train_step=slow_step)
    else:
        run = dataclasses.replace(run, worker=_SlowWorker(run.worker))
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("rows", train_run(run)))
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "pipeline deadlocked"
    rows = result["rows"]
    assert [r["step"] for r in rows] == list(range(7))
    assert max(r["staleness_max"] for r in rows) <= 2
    assert all(r["dropped_batches"] == 0 for r in rows[1:])  # the ahead side waited
    if slow == "trainer":  # a generator that never ran ahead would leave staleness at 0
        assert [r["staleness_max"] for r in rows[3:]] == [2, 2, 2, 2]
        # It ends the run with batches made for steps that never came: counted, not lost.
        out = capsys.readouterr().out
        ahead = re.search(r"info: generation ran ahead of the last step: (\d+) batch\(es\) "
                          r"generated", out)  # fmt: skip
        assert ahead is not None and 1 <= int(ahead.group(1)) <= 3, out[-2000:]
    else:  # the trainer waits for every batch
        assert np.median([r["trainer_idle_fraction"] for r in rows[2:]]) > 0.5
        if batching == "static":  # which it gets fresh; the slot engine starts the next
            # batch's rows while this one's finish (up to k versions before they are trained).
            # Not while step 1 compiles: the generator may run up to k batches ahead then (a
            # CI runner whose compiles came from the persistent cache saw 2 at step 3).
            assert max(r["staleness_max"] for r in rows[4:]) <= 1


def test_a_threaded_run_checkpoints_the_curriculum_of_what_it_trained(tmp_path):
    """The generator thread owns the curriculum and runs k batches ahead of a slow trainer;
    the checkpoint holds the snapshot of the last batch trained, not the generator's live
    curriculum (which has drawn k batches more), so a resumed run redraws those prompts."""
    cfg = _cfg(
        "pipeline.mode=pipeline_rl",
        "pipeline.max_staleness=2",
        "train.steps=5",
        "train.eval_every=0",
        "curriculum.no_positive_resampling=false",  # no prompt skipped: 4 per batch exactly
    )
    run = setup(cfg, tmp_path)
    step = run.train_step
    run = dataclasses.replace(run, train_step=lambda s, b: time.sleep(0.2) or step(s, b))
    rows = train_run(run)
    assert rows[-1]["staleness_max"] == 2  # the generator was k ahead when the run ended
    live = run.worker.curriculum
    assert live.epoch * 64 + live.position >= 4 * 7  # it drew batches 6 and 7 too
    saved = setup(cfg, tmp_path).start.curriculum
    assert int(saved["epoch"]) * 64 + int(saved["position"]) == 4 * 5  # five batches trained


def test_weights_are_asked_for_after_each_chunk_and_not_past_the_last_row(tmp_path):
    """Chunk c's weights are taken once chunk c - 2 has run (the loop stays one chunk ahead
    of the device, so weights published meanwhile reach the wave), and a wave whose rows have
    all ended asks for no more: with rows cut at 5 tokens (forced interruption) in 2-token
    chunks of a 16-token budget, chunks 0-3 are asked for (the rows end in chunk 2; a loop
    running ahead would ask for chunks 0-7)."""
    interrupt = "{text: '123', think_min: 1, think_max: 1, answer_budget: 1, think_end: null}"
    cfg = _cfg(
        "sampler.max_new_tokens=16", "sampler.chunk_size=2", f"sampler.interruption={interrupt}"
    )
    run = setup(cfg, tmp_path)
    params, asked = run.start.train.params, []

    def params_for_chunk(chunk):
        asked.append(chunk)
        return 10 + chunk, params

    ro = run.worker.generate(
        params_for_chunk, [[2, 3, 4]] * 4, jax.random.key(0), sampling=Sampling(1.0), n_new=16
    )
    assert int(np.asarray(ro.lengths).max()) <= 5
    assert asked == [0, 1, 2, 3][: len(asked)] and 1 <= len(asked) <= 4


def test_in_flight_update_gives_one_completion_two_versions(tmp_path):
    run = setup(_cfg("sampler.chunk_size=2"), tmp_path)
    params = run.start.train.params
    ro = run.worker.generate(
        lambda chunk: (10 + chunk, params),  # a new version at every chunk
        [[2, 3, 4]] * 2,
        jax.random.key(0),
        sampling=Sampling(1.0),
        n_new=4,
    )
    v = np.asarray(ro.versions)
    sampled = v >= 0
    # Token j was sampled by the parameters of chunk j // 2, whatever else happened.
    expected = np.broadcast_to(10 + np.arange(4) // 2, v.shape)
    np.testing.assert_array_equal(v[sampled], expected[sampled])
    assert len(set(v[0][sampled[0]].tolist())) >= 2  # one completion, two policy versions
    from jaxrl_scale.rl.step import Batch

    batch = Batch.from_rollout(ro, np.ones(2), np.ones(2, bool))
    # The loss sees each token's own behaviour log-prob, whichever version sampled it.
    np.testing.assert_array_equal(batch.behavior_logp, ro.behavior_logp)


@pytest.mark.parametrize(
    "mode",
    [
        "pipeline.mode=sync",
        "pipeline.mode=pipeline_rl,pipeline.lockstep=true,sampler.batching=static",
        # Checkpoints inside a round; a LoRA run's (adapters, their optimizer, the base's
        # fingerprint) resume as exactly as a full one's.
        "pipeline.mode=ppo_off_policy,pipeline.max_staleness=3,model.lora.rank=4",
        # The slot engine's rows in flight are not checkpointed: a resumed run draws their
        # prompts again and samples them with the restored parameters, so it matches the
        # uninterrupted run up to the checkpoint and goes on from there, nothing skipped.
        "pipeline.mode=pipeline_rl,pipeline.lockstep=true,sampler.batching=continuous",
    ],
)
def test_resume_after_sigkill_matches_an_uninterrupted_run(mode, tmp_path):
    exact = "continuous" not in mode
    steps = 8
    overrides = [
        *mode.split(","),
        f"train.steps={steps}",
        "checkpoint.every=2",
        "train.eval_every=4",
    ]
    cmd = [sys.executable, "-m", "jaxrl_scale.cli", "train", "--config", str(TINY)]
    for o in [*FAST, *overrides]:
        cmd += ["--set", o]
    # The uninterrupted run goes first, in this process. The run that is killed is a process
    # of its own that sees the same 8 CPU devices (conftest's XLA_FLAGS): it runs the very
    # programs this one compiled, handed over by the session's persistent compilation cache.
    # It is resumed here, from what it left on disk, as `train` resumes any run directory.
    env = dict(os.environ)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    train(_cfg(*overrides), whole)
    proc = subprocess.Popen(
        [*cmd, "--out", str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (killed / "checkpoints" / "4").exists():
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    steps_before = [r["step"] for r in read_metrics(killed)]
    assert steps_before[-1] < steps
    saved = max(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    train(_cfg(*overrides), killed)  # resumes from the newest checkpoint
    rows_killed, rows_whole = read_metrics(killed), read_metrics(whole)
    assert [r["step"] for r in rows_killed] == list(range(steps + 1))  # nothing lost or repeated
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    if not exact:  # the same up to the checkpoint the resumed run started from
        assert [strip(r) for r in rows_killed[: saved + 1]] == [
            strip(r) for r in rows_whole[: saved + 1]
        ]
        assert all(r["staleness_max"] <= 1 for r in rows_killed)
        return
    assert [strip(r) for r in rows_killed] == [strip(r) for r in rows_whole]
    for x, y in zip(_params(killed, *overrides), _params(whole, *overrides), strict=True):
        np.testing.assert_array_equal(x, y)


def test_generator_on_its_own_devices_gets_weights_by_device_put(tmp_path):
    devices = jax.devices()
    run = setup(
        _cfg(
            "pipeline.mode=pipeline_rl",
            "pipeline.max_staleness=2",
            "pipeline.generator_devices=4",
            "mesh.data=4",
            "train.steps=4",
        ),
        tmp_path,
    )
    params = run.start.train.params
    assert jax.tree.leaves(params)[0].devices() <= set(devices[:4])
    pushed = run.worker.to_generator(params)
    assert all(leaf.devices() <= set(devices[4:]) for leaf in jax.tree.leaves(pushed))
    frozen = (0, pushed)
    ro = run.worker.generate(
        lambda chunk: frozen, [[2, 3]] * 4, jax.random.key(0), sampling=Sampling(1.0), n_new=4
    )
    assert ro.completion_tokens.devices() == set(devices[4:])
    batch = run.worker.rollouts(lambda chunk: frozen, jax.random.key(1)).batch
    batch = run.worker.to_trainer(batch)  # (it waits on the host until taken)
    for leaf in jax.tree.leaves(batch):  # on the trainer, split over its data axis
        assert leaf.sharding.device_set == set(devices[:4])
        assert not leaf.sharding.is_fully_replicated
    rows = train_run(run)
    assert [r["step"] for r in rows] == list(range(5))
    assert max(r["staleness_max"] for r in rows) <= 2


@pytest.mark.parametrize(
    "devices,batching",
    [("shared", "static"), ("own", "static"), ("shared", "continuous"), ("own", "continuous")],
)
def test_lockstep_pipeline_overlaps_one_batch_swaps_weights_in_flight_and_repeats(
    devices, batching, tmp_path
):
    extra = ["pipeline.mode=pipeline_rl", "pipeline.lockstep=true", "train.steps=5"]
    # 4 new tokens: static decodes 2 chunks, the second with new weights; the slot engine
    # reads its done flags every 2 steps, the first 2 steps with the old weights.
    extra += ["sampler.chunk_size=2", "sampler.admit_every=2", f"sampler.batching={batching}"]
    if devices == "own":
        extra += ["pipeline.generator_devices=4", "mesh.data=4"]
    # The configured k (8) is reduced, and the run says so and why.
    with pytest.warns(UserWarning, match="max_staleness: 8 runs as 1 here: pipeline.lockstep"):
        rows = train(_cfg(*extra), tmp_path / "a")
    assert [r["step"] for r in rows] == list(range(6))
    # The log says the k in effect and what the generator ran.
    assert {(r["staleness_bound"], r["gen_batching"]) for r in rows[1:]} == {(1, batching)}
    # Batch 1 is made before any step; every later batch n was generated while step n - 1
    # ran: its first chunk by version n - 2 (lag 1), its second by version n - 1 (lag 0).
    assert rows[1]["staleness_max"] == 0
    for r in rows[2:]:
        assert r["staleness_max"] == 1
        if batching == "static":  # both versions in one batch: the in-flight swap (the slot
            # engine starts a batch's rows during the step before, and 4-token rows may end
            # there; its swaps per token are tested in test_engine)
            assert 0 < r["staleness_mean"] < 1
    if devices == "shared":
        return
    again = train(_cfg(*extra), tmp_path / "b")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(rows) == strip(again)  # one thread, a fixed order: deterministic
    for x, y in zip(_params(tmp_path / "a", *extra), _params(tmp_path / "b", *extra), strict=True):
        np.testing.assert_array_equal(x, y)


def test_lockstep_needs_a_staleness_bound_of_at_least_one(tmp_path):
    cfg = _cfg("pipeline.mode=pipeline_rl", "pipeline.lockstep=true", "pipeline.max_staleness=0")
    with pytest.raises(ConfigError, match="pipeline.max_staleness"):
        train(cfg, tmp_path)


def test_repeated_non_finite_updates_abort_with_a_clear_error(tmp_path):
    run = setup(_cfg("pipeline.mode=sync", "train.max_nonfinite=2"), tmp_path)
    step = run.train_step

    def poisoned(state, batch):
        return step(state, dataclasses.replace(batch, adv=batch.adv * np.nan))

    with pytest.raises(FloatingPointError, match="2 non-finite losses/gradients in a row"):
        train_run(dataclasses.replace(run, train_step=poisoned))
    skipped = [r["skipped_updates"] for r in read_metrics(tmp_path) if "skipped_updates" in r]
    assert skipped == [1]  # the first skip is logged, the second aborts


def test_warm_start_stops_at_its_target_loss(tmp_path):
    from jaxrl_scale.rl.warm_start import warm_start

    cfg = _cfg()
    # The policy, its task and their placement as a run warm-starts them (the programs the
    # runs above compiled).
    run_parts = setup(cfg, tmp_path)
    params, worker = run_parts.start.train.params, run_parts.worker

    def run(target):
        settings = dataclasses.replace(cfg.warm_start, steps=60, target_loss=target)
        return warm_start(params, worker.graphdef, worker.task, settings, seed=cfg.seed)[1]

    assert len(run(0)) == 60  # no target: every step
    stopped = run(1.7)  # the 50-step mean passes 1.7 between steps 55 and 60 (measured)
    assert 50 < len(stopped) < 60 and np.mean(stopped[-50:]) < 1.7
    assert np.mean(stopped[-51:-1]) >= 1.7  # it stopped at the first step below the target


def test_config_errors_are_named(tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size"):
        setup(_cfg("model.vocab_size=8"), tmp_path)
    with pytest.raises(ConfigError, match="loss.eps_max"):
        _cfg("loss.kind=dapo", "loss.eps_max=4")
    with pytest.raises(ConfigError, match="pipeline.generator_devices"):
        setup(_cfg("pipeline.generator_devices=8"), tmp_path)
    # Held-out waves are filled up to split over the generator's devices (3 prompts x 2
    # samples run as one wave of 4 prompts); a sample count no wave of sampler.slots rows can
    # split over them is refused.
    setup(_cfg("pipeline.generator_devices=4", "task.num_eval=3"), tmp_path / "ok")
    with pytest.raises(ConfigError, match="sampler.slots / train.eval_samples"):
        setup(_cfg("pipeline.generator_devices=4", "sampler.slots=4", "train.eval_samples=3"),
              tmp_path)  # fmt: skip
    # The interruption budget with the text's real token count (3 characters, 3 tokens):
    # 1 + 3 + 1 > sampler.max_new_tokens = 4, though 1 + (at least 1) + 1 fits.
    interrupt = "{text: '123', think_min: 1, think_max: 1, answer_budget: 1, think_end: null}"
    with pytest.raises(ConfigError, match=r"sampler.max_new_tokens: 4 is below .* = 5"):
        setup(_cfg(f"sampler.interruption={interrupt}"), tmp_path)
    with pytest.raises(ConfigError, match="sampler.interruption.think_end: cannot be tokenized"):
        setup(_cfg(f"sampler.interruption={interrupt.replace('null', 'x')}"), tmp_path)


def test_train_cli_prints_the_run(tmp_path, capsys):
    from jaxrl_scale.cli import main

    args = ["train", "--config", str(TINY), "--out", str(tmp_path), "--set", "pipeline.mode=sync"]
    for o in FAST:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out pass rate" in out and str(tmp_path) in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "compute_flops", "device_seconds", "staleness_max"):
        assert all(key in r for r in rows)
    telemetry = ("mismatch", "mismatch_max", "ess_fraction", "seq_ratio_min", "seq_ratio_max")
    trained = [row for row in rows[1:] if row["kept_tokens"] > 0]
    assert trained  # (a step whose every group had equal rewards trains on nothing)
    for row in rows[1:]:  # every training row
        assert row["dropped_batches"] == 0
        assert all(np.isfinite(row[key]) for key in telemetry)
    for row in trained:
        assert 0 < row["ess_fraction"] <= 1 + 1e-6
        assert 0 < row["seq_ratio_min"] <= row["seq_ratio_max"]
        assert row["mismatch"] <= row["mismatch_max"]


def test_a_run_records_its_config_and_version_and_reruns_from_it(tmp_path):
    from jaxrl_scale.cli import main

    cfg = _cfg("pipeline.mode=sync", "train.steps=2", "seed=1")  # test_sweep's second seed
    rows = train(cfg, tmp_path / "first")
    recorded = tmp_path / "first" / "config.yaml"
    assert recorded.read_text().startswith(f"# jaxrl-scale {jaxrl_scale.__version__}, ")
    assert jaxrl_scale.__version__ not in ("", "unknown")  # the installed package's
    assert load_config(recorded) == cfg  # every resolved field, overrides included
    argv = ["train", "--config", str(recorded), "--out", str(tmp_path / "again")]
    assert main(argv) == 0
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "again")) == strip(rows)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo's starting policy (warm-started on noisy demonstrations) trained by 45 CISPO
    steps in `sync` mode, the held-out mean@4 pass rate measured before and after on 256
    prompts: the rows of one run for both tests that RL learns (about half a minute on 2 CPU
    cores)."""
    cfg = load_config(
        "asset:demo.yaml",
        [
            "pipeline.mode=sync",
            "train.steps=45",
            "train.eval_every=45",
            "task.num_eval=256",
            "forecast.every=0",
            "mesh.data=1",
        ],
    )
    return train(cfg, tmp_path_factory.mktemp("demo"))


def test_rl_raises_the_reward_on_its_training_prompts(demo_run):
    """A guard on the sign of the whole loop (advantages, loss, optimizer): from the demo's
    weak starting policy (it puts about half its probability on the right answers), RL lifts
    the reward on the prompts it trains on."""
    rewards = [r["reward_mean"] for r in demo_run[1:]]
    first, last = np.mean(rewards[:8]), np.mean(rewards[-8:])
    assert last - first >= 0.05, (first, last)  # measured: 0.48 -> 0.65


@pytest.mark.slow
def test_rl_raises_the_held_out_pass_rate(demo_run):
    """From the demo's starting policy (warm-started on noisy demonstrations), 45 CISPO steps in
    `sync` mode lift the held-out mean@4 pass rate by at least 0.1 (the demo's curve gains
    about 0.2 by step 45). The shipped tiny config's longer run is
    benchmarks/bench_learning.py."""
    evals = [r["eval_pass_rate"] for r in demo_run if "eval_pass_rate" in r]
    assert len(evals) == 2
    assert evals[-1] - evals[0] >= 0.1, evals
