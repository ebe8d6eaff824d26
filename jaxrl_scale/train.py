"""The RL loop, readable top to bottom: `setup` builds the run's parts, `train_run` runs it.

How data flows from prompt to parameter update:

    curriculum (prompt indices)            rollout.RolloutWorker.rollouts, on the feeding thread
    -> sampler: prefill once per prompt, decode chunk c with params_for_chunk(c)
       (in-flight updates; every token tagged with the version that sampled it)
    -> task verifier (rewards) -> group advantages, zero-variance mask
    -> Batch on the trainer's devices + a snapshot of the curriculum
    -> feeder (pipeline.py: sync | ppo_off_policy | pipeline_rl thread | lockstep) keeps k
    -> train step (step.py, compiled once, state donated) -> new params
    -> feeder.trained(params, version): published to the generator (in flight)
    -> metrics of the step read one step late; every N steps: held-out eval, forecast, checkpoint

Modes: `sync` (k = 0: generate with the current policy, then train; deterministic for a seed),
`ppo_off_policy` (generate k batches with one policy, then take k steps), `pipeline_rl` (a
generator thread and the trainer run concurrently, at most k versions apart; with
`pipeline.lockstep`, and always across processes, one thread in a fixed order).

Who owns what. Main thread: the train state, the feeder's consumer side, the metrics writer,
the forecaster, the checkpointer, the run's totals. Feeding thread (the main thread except in
threaded pipeline_rl): the rollout worker's curriculum; checkpoints save the snapshot each
batch carries. Shared, with a lock: ParamsSource (pipeline.py), the math verifier, RunClock.
Across processes, process 0 alone writes and reads back the metrics log and forecasts; its
decision to stop early reaches the others by a broadcast.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import math
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxrl_scale
from jaxrl_scale.config import ExperimentConfig, dump_config, resolve_paths
from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.fit.data import curve_from_rows
from jaxrl_scale.fit.forecast import OnlineForecast
from jaxrl_scale.memory.check import check_fits
from jaxrl_scale.models import lora
from jaxrl_scale.models.hf import load_pretrained, save_tokenizer
from jaxrl_scale.models.peft import load_adapter, resolve_lora
from jaxrl_scale.models.policy import Policy
from jaxrl_scale.parallel import distributed, sharding
from jaxrl_scale.rl.checkpoint import Checkpointer, RunState, abstract_like
from jaxrl_scale.rl.compute import RunClock
from jaxrl_scale.rl.metrics import MetricsWriter, read_metrics
from jaxrl_scale.rl.packing import PackedBatch
from jaxrl_scale.rl.pipeline import (
    ParamsSource,
    make_feeder,
    staleness_bound,
    staleness_in_effect,
)
from jaxrl_scale.rl.rollout import Rollouts, RolloutWorker, rollouts_from_host, rollouts_to_host
from jaxrl_scale.rl.step import Batch, compile_run_step, init_train_state, make_optimizer
from jaxrl_scale.rl.warm_start import warm_start
from jaxrl_scale.tasks import make_task

TOTALS = (
    "compute_flops",
    "device_seconds",
    "tokens",
    "skipped_updates",
    "dropped_batches",
    "lost_rows",
)


@dataclasses.dataclass(frozen=True)
class Run:
    """The parts of one run (the composition root's output)."""

    cfg: ExperimentConfig  # resolved: a Hugging Face start fixes the model fields
    out: Path
    worker: RolloutWorker
    train_step: Callable  # (TrainState, Batch) -> (TrainState, metrics); donates the state
    new_train_state: Callable  # params -> a fresh TrainState on the trainer's mesh
    start: RunState  # fresh, or restored from the newest checkpoint
    resumed: bool
    checkpointer: Checkpointer
    devices: int  # every device the run holds (trainer's and generator's)
    frozen: Any = None  # a LoRA policy's base (lora.py): read by the step, never donated


def setup(cfg: ExperimentConfig, out: str | Path, *, resume: bool = True, task=None) -> Run:
    """Build a run's parts from its config, resuming from `out`'s newest checkpoint. `task`:
    a user's task object (tasks.Task) in place of the one task.name names."""
    if task is not None and cfg.hosts.generator_groups:
        raise ConfigError(
            "train(task=...): a task object cannot reach generator jobs on other hosts; name "
            "it by import path in task.name (importable on every host) instead"
        )
    cfg = resolve_paths(cfg)  # RUN/config.yaml reruns from any directory
    # ---------------------------------------------------------------- processes and meshes
    distributed.initialize(cfg.distributed)  # several processes: jax.distributed first
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mesh, gen_mesh = sharding.make_meshes(cfg)
    sharding.check_divisible(cfg, mesh, gen_mesh)
    # ---------------------------------------------------------------- model and task
    m, tokenizer = cfg.model, None
    if m.lora.init_from:  # a PEFT adapter fixes the adapters' shape
        m = dataclasses.replace(m, lora=resolve_lora(m.lora))
        cfg = dataclasses.replace(cfg, model=m)
    _say(f"setup: the policy from {m.init_from}" if m.init_from else
         f"setup: a {m.architecture} policy from seed {cfg.seed}")  # fmt: skip
    if m.init_from:
        model, tokenizer = load_pretrained(
            m.init_from, mesh=mesh, seed=cfg.seed, **m.runtime_fields()
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(model.cfg, init_from=m.init_from))
    else:
        model = sharding.init_sharded(lambda rngs: Policy(m, rngs=rngs), mesh, cfg.seed)
    # With LoRA, `params` are the adapters and `frozen` the base (lora.py); else frozen is None.
    graphdef, frozen, params = lora.split_policy(model, cfg.model)
    if cfg.model.lora.init_from:
        params = load_adapter(cfg.model.lora.init_from, params, cfg.model)
    task_object, task = task, make_task(cfg.task, seed=cfg.seed, tokenizer=tokenizer, task=task)
    _say(f"setup: task {getattr(task, 'name', cfg.task.name)}: {len(task.train_examples)} "
         f"training and {len(task.eval_examples)} held-out examples")  # fmt: skip
    for part in (getattr(task, "components", None) or {"": task}).values():  # code tasks
        box = getattr(getattr(part, "obj", part), "sandbox", None)
        if box is not None and distributed.is_main():
            print(f"{part.name}: model-written programs run sandboxed ({box.isolation})")
    worker = RolloutWorker(cfg, task, graphdef, mesh=mesh, gen_mesh=gen_mesh, frozen=frozen)
    used = {d for m_ in (mesh, gen_mesh) if m_ is not None for d in m_.devices.flat
            if d.process_index == jax.process_index()}  # fmt: skip
    check_fits(cfg, worker.longest_prompt, devices=len(used))  # before the run compiles
    if distributed.is_main():  # the resolved config reruns the run: --config RUN/config.yaml
        save_tokenizer(worker.tok, out / "tokenizer")  # what export reads (no task)
        stamp = f"jaxrl-scale {jaxrl_scale.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}"
        header = f"{stamp}\nresolved config"
        if task_object is not None:  # the YAML alone does not rerun this run
            header += f"\ntask: a Python object ({type(task_object).__name__}), not task.name's"
        (out / "config.yaml").write_text(dump_config(cfg, header=header))
    # ---------------------------------------------------------------- optimiser and train step
    tx = make_optimizer(cfg.optim, total_steps=cfg.train.steps)
    reference = bool(cfg.loss.kl_coef)  # GRPO's KL pulls towards the policy RL starts from
    state = init_train_state(params, tx, reference=reference)
    state_sharding = sharding.train_state_shardings(state, mesh)
    n_new = cfg.sampler.max_new_tokens
    rows = cfg.train.prompts_per_step * cfg.train.group_size
    # A step for each layout, compiled on first use (jit): the one train.packing picks, and
    # the other for batches of the other layout waiting in a checkpoint of another setting.
    # A packed batch's row count is a shape of its own: its step compiles per bucket.
    packing = worker.packing
    steps = {}
    for kind, shapes in (  # (shapes for the shardings, which follow each leaf's rank)
        (Batch, Batch.shapes(rows, 1, n_new, cfg.model)),
        (PackedBatch, PackedBatch.shapes(1, 1, rows, cfg.model)),
    ):
        compile_step = functools.partial(
            compile_run_step, cfg, graphdef, tx, state_sharding=state_sharding,
            batch_sharding=sharding.batch_shardings(shapes, mesh),
            rows_per_micro=packing.rows_per_micro if kind is PackedBatch and packing else None,
        )  # fmt: skip
        if frozen is None:
            steps[kind] = compile_step()
        else:  # the base rides beside the donated state, as an argument of its own
            steps[kind] = compile_step(frozen_sharding=sharding.state_shardings(frozen, mesh))

    def train_step(state, batch):
        step = steps[type(batch)]
        return step(state, batch) if frozen is None else step(state, batch, frozen)

    def new_train_state(params):
        return jax.device_put(init_train_state(params, tx, reference=reference), state_sharding)

    # ---------------------------------------------------------------- resume
    # The resume order: the train state (parameters, optimizer, step) onto this run's mesh;
    # the curriculum as of the last batch drawn; the rng key and running totals; the batches
    # generated but not trained on (sync, ppo_off_policy, lockstep), on the host,
    # those staler than this run's k dropped and counted (pipeline.make_feeder); then the
    # metrics rows after the checkpoint's step are cut (MetricsWriter) and the forecaster
    # replays the eval curve so far (train_run; both on process 0, which alone keeps the log).
    checkpointer = Checkpointer(out, keep=cfg.checkpoint.keep)
    # A LoRA checkpoint holds the adapters and a fingerprint of the base they sit on (the base
    # itself is the config's: model.init_from or the seed), checked on resume.
    base_fingerprint = None if frozen is None else lora.fingerprint(frozen)
    restored = None
    if resume:
        restored = checkpointer.restore_latest(
            abstract_like(jax.device_put(state, state_sharding)),
            lambda tree: rollouts_from_host(tree, router_replay=cfg.model.router_replay),
            base=base_fingerprint,
        )
    if restored is not None:
        worker.curriculum.load_state_dict(restored.curriculum)
        restored = dataclasses.replace(
            restored, totals={**dict.fromkeys(TOTALS, 0), **restored.totals}
        )
    start = restored or RunState(
        step=0,
        train=jax.device_put(state, state_sharding),
        curriculum=worker.curriculum.state_dict(),
        key=jax.random.key(cfg.seed),
        totals=dict.fromkeys(TOTALS, 0),
        pending=[],
        base=base_fingerprint,
    )
    devices = mesh.devices.size + (gen_mesh.devices.size if gen_mesh is not None else 0)
    if cfg.hosts.generator_groups:  # the generator jobs' devices count on the x-axis too
        from jaxrl_scale.hosts.hub import generator_devices, static_waves

        devices += cfg.hosts.generator_groups * generator_devices(cfg)
        why = static_waves(cfg)
        if why is not None and distributed.is_main():
            warnings.warn(why, stacklevel=2)
    return Run(
        cfg,
        out,
        worker,
        train_step,
        new_train_state,
        start,
        restored is not None,
        checkpointer,
        devices,
        frozen,
    )


def train(
    cfg: ExperimentConfig, out: str | Path, *, resume: bool = True, task=None
) -> list[dict[str, Any]]:
    """Train with RL per `cfg`, writing metrics, TensorBoard logs and checkpoints under `out`.
    `task`: your own task object (`jaxrl_scale.tasks.Task`), in place of task.name's."""
    return train_run(setup(cfg, out, resume=resume, task=task))


def train_run(run: Run) -> list[dict[str, Any]]:
    """Run the RL loop of `run` to `train.steps` (or an early stop); the rows it logged."""
    cfg, worker, start = run.cfg, run.worker, run.start
    train_state, key, totals = start.train, start.key, dict(start.totals)
    metrics_log = MetricsWriter(
        run.out, resume_step=start.step if run.resumed else None, enabled=distributed.is_main()
    )
    samples_log = MetricsWriter(  # log.rollouts: samples of each step's batch
        run.out, tensorboard=False, name="rollouts.jsonl",
        resume_step=start.step if run.resumed else None,
        enabled=distributed.is_main() and cfg.log.rollouts > 0,
    )  # fmt: skip
    forecasts = _Forecasts(cfg, worker.task)  # the eval curve's, and each domain's
    rows: list[dict[str, Any]] = []
    t = cfg.train
    progress = _Progress(t.steps, start.step, t.prompts_per_step * t.group_size,
                         enabled=distributed.is_main())  # fmt: skip
    # ---------------------------------------------------------------- warm start, step-0 eval
    if run.resumed:
        if distributed.is_main():  # the log as trimmed just above: only process 0 reads it
            rows_so_far = read_metrics(run.out)
            forecasts.replay(rows_so_far)
    else:
        if cfg.warm_start.steps:
            progress.phase(f"warm start: {cfg.warm_start.steps} supervised steps")
            params, _ = warm_start(train_state.params, worker.graphdef, worker.task,
                                   cfg.warm_start, seed=cfg.seed, frozen=run.frozen)  # fmt: skip
            train_state = run.new_train_state(params)  # a KL reference is this policy
    # Generator jobs evaluate too (`RemoteFeeder.evaluate`): their hub is up before the first
    # evaluation. Other feeders start after it, so no generator runs beside it.
    source, feeder = _feeder(cfg, worker, train_state.params, start, key, remote_only=True)

    def evaluate(params, eval_key, version: int, placed=None) -> dict[str, Any]:
        if hasattr(feeder, "evaluate"):  # by the generator groups, of the published version
            return feeder.evaluate(version, eval_key)
        return worker.evaluate_row(params, eval_key, placed=placed)

    if not run.resumed:
        progress.phase(
            f"evaluating the starting policy: {len(worker.task.eval_examples)} held-out "
            f"prompts x {t.eval_samples} samples (the first evaluation compiles the sampler)"
        )
        evaluation = evaluate(train_state.params, jax.random.fold_in(key, 10**9), start.step)
        if distributed.is_main():  # (the only process with generator jobs' evaluations)
            forecasts.observe(0, 0.0, evaluation)
        rows.append({**dict.fromkeys(("step", "policy_version", "staleness_max"), 0),
                     "compute_flops": 0.0, "device_seconds": 0.0, "tokens": 0,
                     **evaluation})  # fmt: skip
        metrics_log.write(rows[-1])
    # ---------------------------------------------------------------- the loop
    clock = RunClock(run.devices, seconds=totals["device_seconds"])  # from the first RL step
    if feeder is None:
        source, feeder = _feeder(cfg, worker, train_state.params, start, key)
    # What each update moves to a generator (each generator job pulls its own copy).
    update_bytes = worker.update_bytes(train_state.params, remote=source is None)
    unlogged: _Step | None = None  # a step dispatched but not yet read back
    curriculum, step = start.curriculum, start.step
    # What ran, for the rows: the batching here (generator jobs say per batch, `gen_engine`)
    # and the k the batches are held to.
    ran = {
        "gen_batching": "continuous" if worker.continuous is not None else "static",
        "staleness_bound": staleness_in_effect(
            cfg.pipeline, colocated_processes=1 if source is None else jax.process_count()
        ),
    }

    def finish(record: _Step, ended: float, evaluation: dict | None = None) -> dict[str, Any]:
        row = _row(record, ended, totals, clock, cfg, evaluation, ran)
        row["weight_update_bytes"] = update_bytes
        if evaluation is not None and distributed.is_main():
            row.update(forecasts.observe(record.step, row[cfg.forecast.x], evaluation))
        metrics_log.write(row)
        rows.append(row)
        if distributed.is_main():
            progress.step(row)
            if "forecast_status" in row:
                print(forecasts.overall.last.describe(), flush=True)
        return row

    def save() -> None:
        with clock.excluded():
            pending = list(feeder.pending)
            state = RunState(step, train_state, curriculum, key, dict(totals), pending,
                             start.base)  # fmt: skip
            run.checkpointer.save(state, rollouts_to_host)

    progress.phase(
        f"training: steps {start.step + 1}-{t.steps} in {cfg.pipeline.mode} (the first step "
        "compiles the train step)"
        if start.step < t.steps
        else "training: nothing left to do"
    )
    clock.start()
    try:
        for step in range(start.step + 1, cfg.train.steps + 1):
            began = time.perf_counter()
            if not feeder.ready():  # about to wait for a batch: let the step before finish
                jax.block_until_ready(train_state.step)  # first, so `waited` is idle time
            ready = time.perf_counter()
            ro = feeder.next()
            waited = time.perf_counter() - ready
            for sample in ro.samples or ():
                samples_log.write({"step": step, **sample})
            _charge_dropped(feeder.take_dropped(), totals)
            totals["lost_rows"] += feeder.take_lost_rows() if source is None else 0
            staleness = _staleness(ro.versions, version=step - 1, k=staleness_bound(cfg.pipeline))
            batch = worker.to_trainer(ro.batch)  # host rows into their shards
            train_state, metrics = run.train_step(train_state, batch)
            feeder.trained(train_state.params, step)  # lockstep: the next batch starts here
            if unlogged is not None:  # the step before: its metrics are ready (or nearly)
                finish(unlogged, ended=began)
            unlogged = _Step(step, metrics, ro, staleness, began, waited)
            curriculum = (feeder.pending[-1] if feeder.pending else ro).curriculum
            on_eval = bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0
            on_eval = on_eval or step == cfg.train.steps
            on_save = bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0
            if not (on_eval or on_save):
                continue
            # Read now (no later step to overlap with), once: the row below reuses it.
            unlogged = dataclasses.replace(unlogged, metrics=jax.device_get(metrics))
            _check_finite(unlogged.metrics, step, cfg.train.max_nonfinite)
            evaluation = None  # eval_pass_rate, eval_sampling_sd (and per domain)
            if on_eval:
                with clock.excluded():
                    eval_key = jax.random.fold_in(key, 10**9 + step)
                    # The generator's newest copy is this step's: no copy of its own beside it.
                    newest = None if source is None else source.newest()
                    placed = newest[1] if newest is not None and newest[0] == step else None
                    evaluation = evaluate(train_state.params, eval_key, step, placed=placed)
            finish(unlogged, time.perf_counter(), evaluation)
            unlogged = None
            if evaluation is not None and _should_stop(forecasts.overall):
                break
            if on_save:
                save()
        if unlogged is not None:
            finish(unlogged, time.perf_counter())
        save()
    finally:
        feeder.stop()  # joins the generator thread (were it still running, the count below
        # would be approximate: it reads list and dict sizes only)
        if distributed.is_main():
            abandoned = getattr(feeder, "abandoned", 0)  # the generator thread's only
            _report_untrained(feeder.untrained(), abandoned, *run.worker.in_flight())
        clock.stop()
        run.worker.close()
        run.checkpointer.close()
        metrics_log.close()
        samples_log.close()
    return rows


def export_run(run_dir: str | Path, out: str | Path, *, peft_out=None) -> list[Path]:
    """A run's newest checkpoint as a Hugging Face folder at `out` (a LoRA policy merged:
    W + s A B), and with `peft_out` a LoRA run's adapters as a PEFT folder. Reads what
    `load_run_policy` reads, so it works whatever task trained the run; writes nothing into
    the run directory."""
    from jaxrl_scale.models.hf import save_pretrained
    from jaxrl_scale.models.peft import save_adapter

    run_dir, out = Path(run_dir).absolute(), Path(out).absolute()
    for target in (out, None if peft_out is None else Path(peft_out).absolute()):
        if target is not None and (target == run_dir or run_dir in target.parents):
            raise ConfigError(
                f"export --out / --peft: {target} is inside the run directory {run_dir}; "
                "export writes elsewhere and leaves the run as it is"
            )
    policy = load_run_policy(run_dir)
    m = policy.cfg.model
    if peft_out is not None and not m.lora.enabled:
        raise ConfigError(f"--peft: {run_dir} is not a LoRA run (model.lora.rank = 0)")
    written = [save_pretrained(policy.model, policy.tokenizer, out)]
    if peft_out is not None:
        written.append(save_adapter(policy.params, m, peft_out, base=m.init_from))
    return written


@dataclasses.dataclass(frozen=True)
class RunPolicy:
    """A run's newest checkpoint as a policy: the module (a LoRA policy's adapters on its
    base), the tokenizer it trained with, the run's config, the step, the trainable params."""

    model: Any
    tokenizer: Any
    cfg: ExperimentConfig
    step: int
    params: Any


def load_run_policy(run_dir: str | Path, *, devices=None) -> RunPolicy:
    """The policy of a run's newest readable checkpoint, read from the run's config.yaml (the
    model), tokenizer/ and the checkpoint's parameters only: no task, no curriculum, no
    sandbox; a LoRA run also reads its base (model.init_from, else the seed's). Nothing is
    written into the run directory. `devices`: where the model is built (default: the first
    CPU device, host memory, so a run loads on a machine without its accelerators)."""
    from flax import nnx

    from jaxrl_scale.config import MeshConfig, load_config
    from jaxrl_scale.rl.checkpoint import restore_params

    run_dir = Path(run_dir).absolute()
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a run directory)")
    cfg = load_config(run_dir / "config.yaml")
    m = cfg.model
    tokenizer = _run_tokenizer(run_dir, cfg)
    devices = list(devices) if devices is not None else jax.local_devices(backend="cpu")[:1]
    mesh = sharding.make_mesh(MeshConfig(data=len(devices)), devices=devices)
    if m.lora.enabled:  # the base's weights are the config's, not the checkpoint's
        if m.init_from:
            m_base = dataclasses.replace(m, lora=dataclasses.replace(m.lora, init_from=None))
            model, _ = load_pretrained(m.init_from, mesh=mesh, seed=cfg.seed,
                                       **m_base.runtime_fields())  # fmt: skip
        else:
            model = sharding.init_sharded(lambda rngs: Policy(m, rngs=rngs), mesh, cfg.seed)
        graphdef, frozen, params = lora.split_policy(model, m)
        abstract = abstract_like(params)
        base = lora.fingerprint(frozen)
    else:
        model = nnx.eval_shape(lambda: Policy(m, rngs=nnx.Rngs(0)))
        graphdef, frozen, params = lora.split_policy(model, m)
        place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place),
                                params)  # fmt: skip
        base = None
    step, params = restore_params(run_dir, abstract, base=base)
    model = lora.merge_policy(graphdef, params, frozen)
    return RunPolicy(model, tokenizer, cfg, step, params)


def _run_tokenizer(run_dir: Path, cfg: ExperimentConfig):
    """The tokenizer the run trained with: RUN/tokenizer (written at setup), else that of
    model.init_from for runs from before that folder."""
    from jaxrl_scale.models.hf import load_tokenizer, resolve_checkpoint

    if (run_dir / "tokenizer" / "tokenizer.json").exists():
        return load_tokenizer(run_dir / "tokenizer")
    if cfg.model.init_from:
        return load_tokenizer(resolve_checkpoint(cfg.model.init_from))
    raise FileNotFoundError(
        f"{run_dir}: no tokenizer/ folder (a run started before runs kept their tokenizer) "
        "and no model.init_from to take the tokenizer from"
    )


# --------------------------------------------------------------------------- helpers


def _feeder(
    cfg: ExperimentConfig, worker: RolloutWorker, params, start: RunState, key, *,
    remote_only: bool = False,
):  # fmt: skip
    """(the generator's ParamsSource or None, the feeder): generator jobs on other hosts
    (`hosts.generator_groups`) are fed through the hub; else pipeline.py's feeders
    (`remote_only`: (None, None) for those)."""
    if remote_only and not cfg.hosts.generator_groups:
        return None, None
    if cfg.hosts.generator_groups:
        from jaxrl_scale.hosts.hub import RemoteFeeder  # the transport: only where it is used

        k = staleness_bound(cfg.pipeline)
        return None, RemoteFeeder(cfg, worker, params, version=start.step, k=k)
    source = ParamsSource(start.step, params, place=worker.to_generator)
    feeder = make_feeder(
        cfg.pipeline,
        worker.rollouts,
        source,
        key,
        version=start.step,
        chunks=worker.chunks,
        multiprocess=jax.process_count() > 1,
        resumed=start.pending,
        idle=worker.idle,
    )
    return source, feeder


class _Forecasts:
    """The online forecast of the eval curve, and of each domain's for a mixture (its fields
    in the row suffixed /<domain>). Only the overall forecast can stop the run. Main thread."""

    def __init__(self, cfg: ExperimentConfig, task):
        self.cfg = cfg
        self.overall = OnlineForecast(cfg.forecast, cfg.train.steps, seed=cfg.seed)
        domains = getattr(task, "components", None) or {}
        self.domains = {
            d: OnlineForecast(cfg.forecast, cfg.train.steps, seed=cfg.seed) for d in domains
        }

    def replay(self, rows: list[dict]) -> None:
        x = self.cfg.forecast.x
        self.overall.replay(curve_from_rows(rows, x=x, clean=False))
        for d, forecast in self.domains.items():
            forecast.replay(curve_from_rows(rows, x=x, y=f"eval_pass_rate/{d}", clean=False))

    def observe(self, step: int, x: float, evaluation: dict) -> dict:
        """The forecast fields for the row of an evaluation (none when no refit is due)."""
        fields = {}
        for d, forecast in [("", self.overall), *self.domains.items()]:
            suffix = f"/{d}" if d else ""
            rate = evaluation[f"eval_pass_rate{suffix}"]
            got = forecast.observe(step, x, rate, evaluation[f"eval_sampling_sd{suffix}"]) or {}
            fields.update({f"{k}{suffix}": v for k, v in got.items()})
        return fields


def _say(text: str) -> None:
    """A setup phase, on process 0's stdout."""
    if distributed.is_main():
        print(text, flush=True)


def _should_stop(forecaster: OnlineForecast) -> bool:
    """Whether the run stops early after this evaluation (`forecast.stop_when_gain_below`).
    Process 0 decides, from the forecast it alone keeps, and every process follows: were each
    to decide for itself, one could stop while the others go on into the next step's
    collectives and wait there."""
    reason = forecaster.should_stop() if distributed.is_main() else None
    if reason is not None:
        print(reason, flush=True)
    return distributed.decided_by_main(reason is not None)


def _report_untrained(batches: int, abandoned: int, queued: int, generated: int) -> None:
    """What generation ran ahead of the last step, said once as information (normal in
    pipeline_rl and on the slot engine): `batches` generated ahead (`abandoned` of them
    stopped mid-generation), `queued` prompts drawn into the engine (`generated` of their
    rows generated or generating)."""
    parts = []
    if batches:
        also = f", {abandoned} stopped mid-generation" if abandoned else ""
        parts.append(f"{batches} batch(es) generated{also}")
    if queued:
        parts.append(f"{queued} prompt(s) queued ({generated} row(s) generated or generating)")
    if parts:
        print(f"info: generation ran ahead of the last step: {'; '.join(parts)}; not trained, "
              "a resumed run draws them again", flush=True)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Step:
    """A dispatched train step, kept until its metrics are read (one step later)."""

    step: int
    metrics: dict[str, jax.Array]
    ro: Rollouts
    staleness: tuple[float, int]
    began: float  # perf_counter when the trainer asked for the batch
    waited: float  # seconds it waited for it


def _staleness(versions: np.ndarray, *, version: int, k: int) -> tuple[float, int]:
    """(mean, max) lag of a batch's sampled tokens behind `version`, the policy it trains."""
    sampled = versions[versions >= 0]
    if sampled.size == 0:
        return 0.0, 0
    lag = version - sampled
    if int(lag.max()) > k:
        raise RuntimeError(f"internal: batch {int(lag.max())} versions old exceeds k = {k}")
    return float(lag.mean()), int(lag.max())


def _check_finite(metrics: dict[str, Any], step: int, limit: int) -> None:
    if int(metrics["nonfinite_in_a_row"]) >= limit:
        raise FloatingPointError(
            f"{int(metrics['nonfinite_in_a_row'])} non-finite losses/gradients in a row at step "
            f"{step}: lower optim.learning_rate or check the model's dtype"
        )


def _row(s: _Step, ended: float, totals: dict, clock: RunClock, cfg, evaluation,
         ran: dict) -> dict:  # fmt: skip
    """The metrics row of step `s`, whose iteration ended at `ended` (reads its metrics from
    the device), totals updated. `ran`: the local generator's `gen_batching` (a generator
    job's batch says its own: `gen_engine`, 1 on the slot engine, 0 in static waves) and the
    `staleness_bound` in effect."""
    metrics = jax.device_get(s.metrics)
    _check_finite(metrics, s.step, cfg.train.max_nonfinite)
    stats = s.ro.stats
    totals["compute_flops"] += stats["gen_flops"] + stats["train_flops"]
    totals["tokens"] += stats["gen_tokens"]
    totals["skipped_updates"] += int(metrics["skipped"])
    totals["device_seconds"] = clock.device_seconds()
    hidden = ("gen_flops", "train_flops", "gen_engine")  # charged; said as gen_batching
    row = {
        "step": s.step,
        "policy_version": s.step,
        **{k: totals[k] for k in ("compute_flops", "device_seconds", "tokens")},
        **{k: v for k, v in stats.items() if k not in hidden},
        **{k: float(v) for k, v in metrics.items() if k != "nonfinite_in_a_row"},
        "staleness_mean": s.staleness[0],
        "staleness_max": s.staleness[1],
        "trainer_idle_fraction": s.waited / max(ended - s.began, 1e-9),
        "tokens_per_s": stats["gen_tokens"] / max(ended - s.began, 1e-9),
        "skipped_updates": totals["skipped_updates"],
        "dropped_batches": totals["dropped_batches"],
        "staleness_bound": ran["staleness_bound"],
        "gen_batching": ran["gen_batching"],
    }
    if "gen_engine" in stats:
        row["gen_batching"] = "continuous" if stats["gen_engine"] else "static"
    if s.staleness[1] == 0:  # every token sampled by the parameters trained: numerics alone
        row["mismatch_numeric"] = row["mismatch"]
        row["mismatch_numeric_max"] = row["mismatch_max"]
    if cfg.hosts.generator_groups:  # rows lost generator groups had in flight (drawn again)
        row["lost_rows"] = totals["lost_rows"]
    if evaluation is not None:
        row.update(evaluation)
    return row


def _charge_dropped(batches: list[Rollouts], totals: dict) -> None:
    """Batches generated but never trained on: counted, logged, and their generation
    compute charged to the x-axis."""
    for ro in batches:
        totals["dropped_batches"] += 1
        totals["compute_flops"] += ro.stats["gen_flops"]
    if batches and distributed.is_main():
        print(
            f"dropped {len(batches)} stale batch(es); {totals['dropped_batches']} so far",
            file=sys.stderr,
            flush=True,
        )


class _Progress:
    """What a run is doing, said on process 0's stdout: one line per setup phase, then the
    steps as `k/N` with samples/s, reward, staleness and the time left. On a terminal a bar
    redrawn in place (kept at evaluations); piped, plain lines: every step when steps take
    `every` seconds or more, else one per `every` seconds, and every evaluation's. Main
    thread."""

    def __init__(self, total: int, first: int, rows_per_step: int, *, enabled: bool,
                 every: float = 5.0, stream=None):  # fmt: skip
        self.total, self.first, self.rows = total, first, rows_per_step
        self.enabled, self.every = enabled, every
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started: float | None = None  # when the first step's row came in
        self.last_line = -math.inf

    def phase(self, text: str) -> None:
        if self.enabled:
            self._print(text)

    def step(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        k, n = row["step"], self.total
        if self.started is None:  # the first step carries the compiles: rates start after it
            self.started, self.started_step = now, k
        done = k - self.started_step
        rate = done / (now - self.started) if done and now > self.started else 0.0
        eta = f"{_duration((n - k) / rate)}" if rate else "-"
        samples = f"{rate * self.rows:.1f}" if rate else "-"
        line = (
            f"step {k}/{n}  {samples} samples/s  reward {row.get('reward_mean', 0):.3f}  "
            f"staleness {row.get('staleness_max', 0)}  ETA {eta}"
        )
        evaluated = "eval_pass_rate" in row
        if evaluated:
            line += f"  eval {row['eval_pass_rate']:.3f}"
        if self.tty:
            width = 20
            filled = round(width * k / max(n, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {line}".ljust(110) + ("\n" if evaluated else ""))
            self.stream.flush()
        elif evaluated or k == n or now - self.last_line >= self.every:
            self._print(line)
            self.last_line = now

    def _print(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + " " * 110 + "\r")  # a bar being redrawn gives way
        print(text, file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _TrainModule(types.ModuleType):
    """This module, callable as its `train`: the package's public face offers
    `jaxrl_scale.train(cfg, out)`, and Python binds a submodule on its package by the
    submodule's name, so `jaxrl_scale.train` is this module whichever was imported first."""

    def __call__(self, cfg: ExperimentConfig, out: str | Path, **kwargs) -> list[dict[str, Any]]:
        return train(cfg, out, **kwargs)


__signature__ = inspect.signature(train)
sys.modules[__name__].__class__ = _TrainModule
