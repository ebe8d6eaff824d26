"""`plan(cfg)`: every program a run puts on each device, planned on the meshes the run builds,
and the verdict against the memory pool."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jaxrl_scale.memory.abstract import (
    GIB,
    abstract_params,
    attention_program,
    default_mem_fraction,
    experts_program,
    task_prompt_len,
)
from jaxrl_scale.memory.generator import (
    bound_evaluation,
    bound_temporaries,
    evaluate_memory,
    float32_config,
    generate_memory,
    generator_devices,
    prefill_memory,
)
from jaxrl_scale.memory.hosts import group_mesh, plan_hosts
from jaxrl_scale.memory.report import advice
from jaxrl_scale.memory.train_step import train_step_memory
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.pipeline import staleness_bound
from jaxrl_scale.rl.rollout import decodes_with_copy
from jaxrl_scale.rl.step import Batch

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def plan(
    cfg: ExperimentConfig,
    *,
    prompt_len: int | None = None,
    device_memory_gib: float | None = None,
    mem_fraction: float | None = None,
    processes: int = 1,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every program's per-device bytes on the config's meshes, what each set of devices
    holds at once, whether that fits the memory pool (`device_memory_gib` x `mem_fraction`,
    when given), and for what does not, its biggest term and the settings that shrink it.

    The generator's devices hold, at once: its parameter copies, the slots' decode state,
    the working memory of whichever of its programs runs (a decode chunk, or the admission /
    prefill that starts rows), and a held-out evaluation (its waves are decoded beside the
    generator, which keeps its slots; in threaded pipeline_rl the two run concurrently, so
    the plan always adds them, an upper bound elsewhere).

    `processes`: the processes the trainer's job spans (one per host); this machine's devices
    are split into that many blocks, each planned as a process's devices (the generator's
    share of every process, `sharding.make_meshes`), so a split the run would refuse is
    refused here too. `say`: told the name of each program as its compile starts."""
    say = say or (lambda text: None)
    source = "--prompt-len"
    if prompt_len is None:
        prompt_len, source = task_prompt_len(cfg)
    if prompt_len < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt_len}")
    if mem_fraction is not None and not 0 < mem_fraction <= 1:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {mem_fraction}")
    attention_note = attention_program(cfg, prompt_len)
    if jax.default_backend() == "cpu" and cfg.model.attention in ("cudnn", "splash"):
        # The fused kernels do not compile for CPU (splash only interpreted): the blockwise
        # attention, whose memory is linear in T as theirs is, stands in for them.
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise"))
    planned, experts_note = experts_program(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_matmul=planned))
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    mesh, gen_mesh = sharding.make_meshes(cfg, processes=processes)
    if cfg.hosts.generator_groups:  # each group's own mesh, planned on devices like theirs
        gen_mesh = group_mesh(cfg)  # (a generator job decodes in static waves)
        cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, batching="static"))
    sharding.check_divisible(cfg, mesh, gen_mesh)
    gmesh = gen_mesh or mesh
    copy = decodes_with_copy(cfg, gen_mesh)
    # A copy of its own: new weights are placed while the generator may still decode with
    # the ones it has (pipeline_rl), or while the source still holds them (every mode), so
    # two copies sit on its devices; never three (`pipeline.ParamsSource`).
    copies = 2 if copy else 1
    own_devices = gen_mesh is not None
    # Evaluation after a step decodes with the generator's newest copy, that step's (the
    # first, before the generator starts, makes one of its own): no copy beside them.
    own_copy = False

    def programs(cfg, note=""):
        # Multi-turn episodes (task.max_turns > 1, rl/episodes.py): the train step's rows
        # hold whole episodes (max_episode_tokens completion columns), and each turn decodes
        # turn_tokens after a context of up to the episode's budget; on the slot engine a
        # slot holds its whole episode (max_episode_tokens completion columns too) after
        # task.prompt_tokens prompt columns (0, sized at run time: at most the budget).
        train_cfg, gen_prompt, gen_cfg = cfg, prompt_len, cfg
        if cfg.task.max_turns > 1:
            t, s = cfg.task, cfg.sampler
            train_cfg = dataclasses.replace(
                cfg, sampler=dataclasses.replace(s, max_new_tokens=t.max_episode_tokens)
            )
            gen_prompt = t.max_episode_tokens
            turn = t.turn_tokens or s.max_new_tokens
            if cfg.batching == "continuous":
                turn = t.max_episode_tokens
                gen_prompt = t.prompt_tokens or gen_prompt
            gen_cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(s, max_new_tokens=turn))
        start = "slot engine admission" if cfg.batching == "continuous" else "prefill"
        say(f"compiling the train step{note} ...")
        out = {"train_step": train_step_memory(train_cfg, mesh, prompt_len)}
        say(f"compiling the decode chunk{note} ...")
        out["generate"] = generate_memory(
            gen_cfg, gmesh, gen_prompt, copy=copy, copies=copies, own_devices=own_devices
        )
        say(f"compiling the {start}{note} ...")
        out["prefill"] = prefill_memory(gen_cfg, gmesh, gen_prompt, copy=copy)
        say(f"compiling the held-out evaluation{note} ...")
        out["evaluate"] = evaluate_memory(gen_cfg, gmesh, gen_prompt, copy=copy, own_copy=own_copy)
        return out

    report = {
        "sequence_length": prompt_len + cfg.sampler.max_new_tokens,
        "prompt_len": prompt_len,
        "prompt_len_from": source,
        "max_new_tokens": cfg.sampler.max_new_tokens,
        "processes": processes,
        "train_mesh": dict(mesh.shape),
        "generate_mesh": dict(gmesh.shape),
        "attention": attention_note,
        **({"experts": experts_note} if experts_note else {}),
        **programs(cfg),
    }
    wide_cfg = float32_config(cfg)
    if wide_cfg is not None:  # the CPU's bf16 programs: the smaller of two upper bounds
        wide = programs(wide_cfg, " in float32 (the CPU's bound for bf16)")
        for name in ("train_step", "generate", "prefill"):
            bound_temporaries(report[name], wide[name]["temporaries_bytes"])
        report["prefill"]["extra_bytes"] = min(
            report["prefill"]["extra_bytes"], wide["prefill"]["extra_bytes"]
        )
        bound_evaluation(report["evaluate"], wide["evaluate"])
    report["generator"] = generator_devices(report)
    report["host_batches"] = host_batches(cfg, prompt_len)
    names = ["train_step", "generator"]
    if processes > 1 and own_devices and not cfg.hosts.generator_groups:
        say("compiling the weight transfer to the generator's devices ...")
        report["weight_transfer"] = plan_transfer(report, cfg, mesh, processes)
        names.append("weight_transfer")
    if cfg.hosts.generator_groups:
        say("compiling the trainer host's version layout for the generator groups ...")
        plan_hosts(report, cfg, mesh, prompt_len)
        names = ["trainer_host", "generator"]
    elif gen_mesh is None:
        # One set of devices: the train state stays while the generator works (pipeline_rl:
        # the train step runs at once too).
        train = report["train_step"]
        if cfg.pipeline.mode == "pipeline_rl":
            both = train["per_device_bytes"]
        else:
            both = train["parameters_bytes"] + train["optimizer_state_bytes"]
        report["train_and_generate"] = {
            "per_device_bytes": both + report["generator"]["per_device_bytes"],
            "concurrent": cfg.pipeline.mode == "pipeline_rl",
        }
        names = ["train_step", "train_and_generate"]
    if device_memory_gib is not None:
        fraction = mem_fraction if mem_fraction is not None else default_mem_fraction()
        pool = int(device_memory_gib * fraction * GIB)
        report["device_memory_bytes"] = int(device_memory_gib * GIB)
        report["mem_fraction"] = fraction
        report["pool_bytes"] = pool
        for name in names:
            part = report[name]
            part["fits"] = part["per_device_bytes"] <= pool
            if not part["fits"]:
                part["advice"] = advice(name, part, cfg, report)
        report["fits"] = all(report[name]["fits"] for name in names)
    return report


def plan_transfer(report: dict[str, Any], cfg: ExperimentConfig, mesh, processes: int) -> dict:
    """A trainer device while new weights move to the generator's devices across processes
    (`distributed.transfer`, after each step): the train state, its share of the weights cast
    to the generator's dtypes, and one leaf at a time gathered onto each process split over
    that process's trainer devices (the largest leaf / the devices of a process)."""
    _, params = abstract_params(cfg, mesh, generation=True)
    leaves = jax.tree.leaves(params)
    largest = max(x.size * x.dtype.itemsize for x in leaves)
    staged = -(-largest // (mesh.devices.size // processes))
    # (the cast copy is laid out as the trainer's weights: its shard on each device)
    cast = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    train = report["train_step"]
    resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
    return {
        "largest_leaf_bytes": largest,
        "staged_leaf_bytes": staged,
        "cast_weights_bytes": cast,
        "per_device_bytes": resident + cast + staged,
    }


def host_batches(cfg: ExperimentConfig, prompt_len: int) -> dict[str, Any]:
    """Scored batches wait on the host (`rollout.Rollouts`): up to k = the staleness bound
    ahead of the trainer (in the feeder's queue, or at the hub of generator jobs on the
    trainer's process 0), and the one it trains, placed in its shards only when taken (on
    the devices it is the train step's batch argument). A batch's bytes as padded rows, with
    router replay's experts (`model.route_dtype`, every prompt and completion position)."""
    rows = cfg.train.prompts_per_step * cfg.train.group_size
    n_new = cfg.task.max_episode_tokens if cfg.task.max_turns > 1 else cfg.sampler.max_new_tokens
    shapes = Batch.shapes(rows, prompt_len, n_new, cfg.model)
    nbytes = lambda x: 0 if x is None else math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
    batch = sum(nbytes(x) for x in jax.tree.leaves(shapes))
    k = staleness_bound(cfg.pipeline)
    return {
        "batch_bytes": batch,
        "routes_bytes": nbytes(shapes.routes),
        "batches": k + 1,
        "host_bytes": (k + 1) * batch,
    }
