"""`jaxrl-scale memory`: compiled from shapes on the fake 8-device CPU mesh, checked against
concrete arrays and against what the settings it names should do."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_scale.cli import main
from jaxrl_scale.config import load_config
from jaxrl_scale.memory import plan, resolve_model
from jaxrl_scale.memory.train_step import train_step_memory
from jaxrl_scale.models import lora
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import sharding
from jaxrl_scale.rl.step import Batch, compile_run_step, init_train_state, make_optimizer

TINY = "configs/tiny_arithmetic.yaml"
# A longer completion than the demo's, so activations are the biggest term; one layer (a
# plan's bytes scale with the layers, its compile time too) unless a test says otherwise.
LONG = [
    "sampler.max_new_tokens=64", "train.prompts_per_step=8", "train.group_size=8",
    "model.num_layers=1",
]  # fmt: skip
# Parameters and optimizer state split over 8 devices: the plan several tests share (the
# programs compiled once, the same again from the persistent compilation cache).
SHARDED = ["mesh.data=1", "mesh.fsdp=8", *LONG]


def test_json_reports_both_programs_and_the_parameters_match_real_shards(capsys):
    overrides = SHARDED
    assert (
        main(["memory", "--config", TINY, "--json", *sum((["--set", o] for o in overrides), [])])
        == 0
    )
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is the report alone; progress is on stderr
    said = [line.split("] ", 1)[1] for line in captured.err.splitlines() if "] " in line]
    compiled = [line for line in said if line.startswith("compiling the ")]
    assert compiled[:4] == ["compiling the train step ...", "compiling the decode chunk ...",
                            "compiling the slot engine admission ...",  # pipeline_rl
                            "compiling the held-out evaluation ..."], captured.err  # fmt: skip
    cfg = load_config(TINY, overrides)
    assert report["sequence_length"] == report["prompt_len"] + 64
    for name in ("train_step", "generate"):
        assert report[name]["per_device_bytes"] > report[name]["arguments_bytes"] > 0
    # Independently: the bytes of one device's shard of every parameter, from real arrays.
    mesh, _ = sharding.make_meshes(cfg)
    model = sharding.init_sharded(lambda rngs: Policy(cfg.model, rngs=rngs), mesh, 0)
    real = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert report["train_step"]["parameters_bytes"] == real
    assert report["train_step"]["optimizer_state_bytes"] >= 2 * real  # Adam's two moments
    assert report["train_step"]["arguments_bytes"] >= 3 * real
    # pipeline_rl on shared devices: the generator's two copies (the one decoding, the
    # newest; bf16 matrices would be smaller, this config computes in float32).
    gen = report["generate"]
    assert gen["parameter_copies"] == 2 and gen["parameters_bytes"] == real
    assert gen["per_device_bytes"] >= gen["arguments_bytes"] + real
    # Both at once: the train step and all the generator's devices hold (its copies and
    # slots, its working memory, held-out evaluation).
    together = report["train_step"]["per_device_bytes"] + report["generator"]["per_device_bytes"]
    assert report["train_and_generate"]["per_device_bytes"] == together
    assert report["generator"]["per_device_bytes"] > gen["per_device_bytes"]


def test_a_config_that_does_not_fit_exits_1_and_names_the_biggest_term(capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    args = ["memory", "--config", TINY, "--device-memory", "0.0001"]
    assert main(args + [f"--set={o}" for o in SHARDED]) == 1
    out = capsys.readouterr().out
    assert "memory pool: 0.1 MiB per device = 0.1 MiB x 0.75" in out
    assert "train step: " in out and ", fits: NO" in out
    assert "temporaries (activations and gradients" in out and "train.micro_batches" in out
    # pipeline_rl on shared devices: both programs at once are judged too.
    assert "train step + generator on the same devices (at once)" in out
    assert "train + generator" in out and "fits: NO" in out
    assert "pipeline.generator_devices" in out


def _temporaries(overrides):
    cfg = load_config(TINY, [*LONG, *overrides])
    mesh, _ = sharding.make_meshes(cfg)
    return train_step_memory(cfg, mesh, 8)["temporaries_bytes"]


def test_the_named_knobs_shrink_the_train_step():
    base = ["mesh.data=1"]
    assert _temporaries([*base, "train.micro_batches=4"]) < 0.6 * _temporaries(base)
    # Two layers, the fewest whose scan has stored activations for remat to drop.
    scanned = [*base, "model.num_layers=2", "model.scan_layers=true"]
    assert _temporaries([*scanned, "model.remat=full"]) < 0.5 * _temporaries(scanned)


def test_micro_batches_keep_their_rows_split_over_the_devices():
    """Each micro-batch's rows stay split over the batch axes: eight devices hold about an
    eighth of one device's activations (every device running every row would hold all)."""
    micro = "train.micro_batches=4"
    one = _temporaries(["mesh.data=1", micro])
    eight = _temporaries(["mesh.data=8", micro])
    assert eight < 0.3 * one, (eight, one)


def test_the_plan_splits_the_devices_over_the_processes_it_is_told_of(capsys):
    """A run refuses a generator share that does not split over its processes (each gives the
    same number of its devices): planned as those processes, the plan refuses it too, where
    as one process it would plan a topology that cannot start."""
    from jaxrl_scale.config import ConfigError

    gen = ["pipeline.mode=pipeline_rl", "pipeline.generator_devices=2", *LONG]
    with pytest.raises(ConfigError, match="same number of devices from each of the 4 proc"):
        plan(load_config(TINY, gen), prompt_len=8, processes=4)  # 2 over 4 processes
    with pytest.raises(ConfigError, match="8 devices do not split over 3 processes"):
        plan(load_config(TINY, gen), prompt_len=8, processes=3)
    args = ["memory", "--config", TINY, "--processes", "4", "--prompt-len", "8", "--json"]
    assert main(args + [f"--set={o}" for o in [*gen, "pipeline.generator_devices=4"]]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["processes"] == 4 and report["generate_mesh"]["data"] == 4
    # Weights cross to the generator's devices after each step, one leaf at a time gathered
    # over a process's trainer devices (one here): the largest, an MLP matrix, 128 x 384 f32.
    moving = report["weight_transfer"]
    assert moving["largest_leaf_bytes"] == moving["staged_leaf_bytes"] == 128 * 384 * 4
    train = report["train_step"]
    resident = train["parameters_bytes"] + train["optimizer_state_bytes"]
    assert moving["cast_weights_bytes"] == train["parameters_bytes"]  # float32: the same
    total = resident + moving["cast_weights_bytes"] + moving["staged_leaf_bytes"]
    assert moving["per_device_bytes"] == total


def test_plan_rejects_a_bad_prompt_length():
    with pytest.raises(ValueError, match="prompt length must be >= 1"):
        plan(load_config(TINY, ["mesh.data=1"]), prompt_len=0)


# Blocks of 4 positions: a prompt (8) spans two, a LONG row (8 + 64) eighteen, so `auto`
# compiles the blockwise attention wherever a plan attends but in decoding (one query).
BLOCKS = ["mesh.data=1", "model.attention_block_size=4", *LONG]


def test_procedural_prompt_length_is_measured():
    # Splash is planned as blockwise on CPU: the programs of the auto plan on BLOCKS in
    # test_the_plan_says_which_attention_it_compiled.
    report = plan(load_config(TINY, [*BLOCKS, "model.attention=splash"]))
    assert report["prompt_len"] % 8 == 0 and 0 < report["prompt_len"] <= 16
    assert "arithmetic prompts" in report["prompt_len_from"]
    assert np.isfinite(report["train_step"]["per_device_bytes"])
    # A TPU kernel does not compile for CPU: the plan says what stood in for it.
    assert report["attention"] == "splash estimated as blockwise on CPU"


def test_bf16_generator_on_its_own_devices_reports_its_copy_and_the_smaller_bound():
    overrides = [
        "pipeline.generator_devices=4", "mesh.data=1", "mesh.fsdp=4", "sampler.slots=16", *LONG
    ]  # fmt: skip
    cfg = load_config(TINY, [*overrides, "model.dtype=bfloat16"])
    report = plan(cfg, prompt_len=8)
    gen = report["generate"]
    # The generator's copy (replicated over its data axis): bf16 layer matrices beside the
    # float32 norms and tied embedding, from real arrays.
    copy = for_generation(nnx.state(Policy(cfg.model, rngs=nnx.Rngs(0))), cfg.model)
    assert gen["parameters_bytes"] == sum(x.nbytes for x in jax.tree.leaves(copy))
    assert gen["parameters_bytes"] < report["train_step"]["parameters_bytes"] * 4  # < f32 whole
    # The CPU compiles bf16 matmuls on float32 copies of their operands: at least the cache's
    # bytes twice. The float32 program, compiled independently here, has no such copies.
    assert gen["temporaries_bytes_as_compiled"] >= 2 * gen["kv_cache_bytes"]
    wide = plan(load_config(TINY, [*overrides, "model.dtype=float32"]), prompt_len=8)
    for name in ("train_step", "generate"):
        part = report[name]
        assert part["temporaries_bytes_float32_program"] == wide[name]["temporaries_bytes"]
        assert part["temporaries_bytes"] == min(
            part["temporaries_bytes_as_compiled"], part["temporaries_bytes_float32_program"]
        )
        extra = (part.get("parameter_copies", 1) - 1) * part["parameters_bytes"]
        assert part["per_device_bytes"] == (
            part["arguments_bytes"] + part["temporaries_bytes"] + part["outputs_bytes"] + extra
        )
    assert gen["temporaries_bytes"] < gen["temporaries_bytes_as_compiled"]
    assert "train_and_generate" not in report  # the generator has its own devices


def _live_bytes_per_device() -> dict[int, int]:
    """Bytes of every live jax array on each device (a replicated array on each of its)."""
    out: dict[int, int] = {}
    for x in jax.live_arrays():
        try:
            if x.is_deleted():
                continue
            n = int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
            devices = x.sharding.device_set
        except RuntimeError:  # deleted (donated) while being read
            continue
        for d in devices:
            out[d.id] = out.get(d.id, 0) + n
    return out


def test_the_generator_plan_covers_the_live_buffers_of_a_real_run(tmp_path):
    """A tiny pipeline_rl run with its own generator devices, long enough completions that
    the KV cache dominates, and held-out evaluation on those devices: the most that was ever
    live on one generator device (sampled every few ms on another thread) lies within the
    plan's arrays (parameter copies, the slots' state, the evaluation wave's state and copy)
    and no more than 35% below them; the plan's total, which adds the programs' working
    memory, is above it."""
    import threading
    import time

    from conftest import FAST, TINY_CONFIG

    from jaxrl_scale.train import setup, train_run

    cfg = load_config(TINY_CONFIG, [
        *FAST, "mesh.data=4", "pipeline.generator_devices=4", "sampler.slots=16",
        "sampler.max_new_tokens=128", "model.hidden_size=64", "model.num_layers=1",
        "train.steps=2", "train.eval_every=2", "task.num_eval=32", "train.eval_samples=4",
        "pipeline.lockstep=true", "warm_start.steps=0",
    ])  # fmt: skip
    report = plan(cfg)
    gen = report["generator"]
    arrays = gen["per_device_bytes"] - gen["working_bytes"] - report["evaluate"]["working_bytes"]
    peak: dict[int, int] = {}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for d, n in _live_bytes_per_device().items():
                peak[d] = max(peak.get(d, 0), n)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run = setup(cfg, tmp_path)
        train_run(run)
    finally:
        stop.set()
        sampler.join(timeout=10)
    measured = max(peak[d.id] for d in run.worker.gen_mesh.devices.flat)
    print(f"live peak {measured:,} of the plan's arrays {arrays:,}")
    assert 0.65 * arrays <= measured <= arrays < gen["per_device_bytes"], (measured, gen)


def test_the_plan_covers_admission_evaluation_and_the_pool(capsys, monkeypatch):
    """Every program on the generator's devices is planned and added: the decode chunk or
    the engine's admission (whichever needs more), the slots' state, the parameter copies
    and held-out evaluation, in waves bounded by sampler.slots; the verdict is against the
    pool JAX gets (XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 0.75 unless set)."""
    # The trainer's layout and the generator's programs of the float32 plan in
    # test_bf16_generator_on_its_own_devices_reports_its_copy_and_the_smaller_bound.
    overrides = ["pipeline.generator_devices=4", "mesh.data=1", "mesh.fsdp=4",
                 "sampler.slots=16", "task.num_eval=40", "train.eval_samples=4", *LONG]  # fmt: skip
    cfg = load_config(TINY, overrides)
    report = plan(cfg, prompt_len=8)
    gen, ev, first = report["generator"], report["evaluate"], report["prefill"]
    assert first["program"] == "slot engine admission" and first["extra_bytes"] > 0
    # Waves of at most sampler.slots rows (4 prompts x 4 samples), split over 4 devices.
    assert ev["rows_per_wave"] == 16 and ev["waves"] == 10
    assert ev["decode_state_bytes"] == report["generate"]["decode_state_bytes"]
    assert gen["working_bytes"] == max(
        first["extra_bytes"],
        report["generate"]["temporaries_bytes"] + report["generate"]["outputs_bytes"],
    )
    assert gen["per_device_bytes"] == (
        gen["parameters_bytes"] + gen["decode_state_bytes"] + gen["working_bytes"]
        + ev["per_device_bytes"]
    )  # fmt: skip
    # A device just large enough at fraction 1 fails under JAX's default GPU pool.
    need = max(gen["per_device_bytes"], report["train_step"]["per_device_bytes"])
    gib = need / 2**30
    assert plan(cfg, prompt_len=8, device_memory_gib=gib * 1.01, mem_fraction=1.0)["fits"]
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    tight = plan(cfg, prompt_len=8, device_memory_gib=gib * 1.01)
    assert tight["mem_fraction"] == 0.75 and not tight["fits"]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.99")
    assert plan(cfg, prompt_len=8, device_memory_gib=gib * 1.02)["fits"]
    with pytest.raises(ValueError, match="--mem-fraction must be in"):
        plan(cfg, prompt_len=8, device_memory_gib=1, mem_fraction=1.5)


def test_the_plan_says_which_attention_it_compiled():
    long = plan(load_config(TINY, BLOCKS))
    assert long["attention"].startswith("auto compiled as blockwise on cpu")
    assert "a GPU runs cudnn" in long["attention"]
    short = plan(load_config(TINY, SHARDED))  # every key in one block (72 of 512)
    assert short["attention"].startswith("auto compiled as xla")


# --------------------------------------------------------------------------- LoRA

LORA = ["model.lora.rank=4", "model.lora.base_dtype=bfloat16"]


def _kernel_and_adapter_sizes(cfg) -> tuple[int, int]:
    """(elements of the layers' projection kernels, of their rank-r adapters), by hand from
    the model's shape: q [D, H E], k and v [D, K E], o [H E, D], gate and up [D, F],
    down [F, D]; an adapter of W [in, out] is A [in, r] and B [r, out]."""
    m = cfg.model
    d, f, r = m.hidden_size, m.intermediate_size, m.lora.rank
    q, kv = m.num_heads * m.resolved_head_dim, m.num_kv_heads * m.resolved_head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    kernels = sum(i * o for i, o in shapes)
    adapters = sum(r * (i + o) for i, o in shapes)
    return m.num_layers * kernels, m.num_layers * adapters


def _run_train_step(cfg, prompt_len: int) -> dict[str, int]:
    """The train step exactly as a run builds it (`train.setup`: real arrays, split by
    `lora.split_policy`, `init_train_state`, the run's shardings), compiled: XLA's bytes."""
    mesh, _ = sharding.make_meshes(cfg)
    model = sharding.init_sharded(lambda rngs: Policy(cfg.model, rngs=rngs), mesh, 0)
    graphdef, frozen, params = lora.split_policy(model, cfg.model)
    tx = make_optimizer(cfg.optim, total_steps=cfg.train.steps)
    state = init_train_state(params, tx)
    state_sharding = sharding.train_state_shardings(state, mesh)
    rows = cfg.train.prompts_per_step * cfg.train.group_size
    shapes = Batch.shapes(rows, prompt_len, cfg.sampler.max_new_tokens)
    batch_sharding = sharding.batch_shardings(shapes, mesh)
    batch = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, batch_sharding
    )
    frozen_sharding = None if frozen is None else sharding.state_shardings(frozen, mesh)
    step = compile_run_step(
        cfg, graphdef, tx, state_sharding=state_sharding, batch_sharding=batch_sharding,
        frozen_sharding=frozen_sharding,
    )  # fmt: skip
    args = (state, batch) if frozen is None else (state, batch, frozen)
    m = step.lower(*args).compile().memory_analysis()
    real = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((params, frozen)))
    return {
        "arguments_bytes": int(m.argument_size_in_bytes),
        "temporaries_bytes": int(m.temp_size_in_bytes),
        "outputs_bytes": int(m.output_size_in_bytes - m.alias_size_in_bytes),
        "parameters_bytes": real,
    }


@pytest.mark.parametrize("extra", [[], LORA], ids=["rank0", "lora"])
def test_the_plan_compiles_the_train_step_a_run_builds(extra):
    """Rank 0 plans today's program; with LoRA, the run's (the base a non-donated argument
    of its own, the adapters the train state): the same bytes as compiling the step from
    the real arrays a run makes."""
    cfg = load_config(TINY, [*SHARDED, *extra])
    mesh, _ = sharding.make_meshes(cfg)
    planned = train_step_memory(cfg, mesh, 8)
    run = _run_train_step(cfg, 8)
    for key, value in run.items():
        assert planned[key] == value, key
    assert ("lora" in planned) == bool(extra)


def test_lora_plan_counts_base_adapters_and_their_optimizer_state_by_hand():
    """On a batch-only mesh (every parameter whole on each device): the adapters are float32
    A and B of the shapes above, Adam's two moments are over them alone, the base holds its
    layer kernels in bfloat16 and everything else as full fine-tuning does."""
    # The full fine-tuning step is test_micro_batches_keep_their_rows_split_over_the_devices'
    # eight-device one (micro-batches change no state's bytes).
    batch_only = ["mesh.data=8", "train.micro_batches=4", *LONG]
    full_cfg = load_config(TINY, batch_only)
    cfg = load_config(TINY, [*batch_only, *LORA])
    mesh, _ = sharding.make_meshes(cfg)
    full = train_step_memory(full_cfg, mesh, 8)
    planned = train_step_memory(cfg, mesh, 8)
    kernels, adapters = _kernel_and_adapter_sizes(cfg)
    part = planned["lora"]
    assert part["adapter_bytes"] == 4 * adapters
    # The same optimizer's scalars (Adam's step count) beside two float32 moments.
    scalars = full["optimizer_state_bytes"] - 2 * full["parameters_bytes"]
    assert 0 <= scalars <= 64
    assert planned["optimizer_state_bytes"] == 2 * 4 * adapters + scalars
    assert part["frozen_base_bytes"] == full["parameters_bytes"] - 2 * kernels  # 4 -> 2 bytes
    assert planned["parameters_bytes"] == part["frozen_base_bytes"] + part["adapter_bytes"]
    # Full fine-tuning's side of the comparison is the rank-0 plan's.
    ft = part["full_fine_tuning"]
    assert ft["parameters_bytes"] == ft["gradient_bytes"] == full["parameters_bytes"]
    assert ft["optimizer_state_bytes"] == full["optimizer_state_bytes"]
    assert part["saving_bytes"] == ft["state_bytes"] - part["state_bytes"] > 0
    assert part["state_bytes"] == (
        part["frozen_base_bytes"] + 2 * part["adapter_bytes"] + planned["optimizer_state_bytes"]
    )


def test_lora_holds_less_per_device_than_full_fine_tuning_on_fsdp_8(capsys):
    """Where the parameters' state is what a device holds most of (a wider model, short
    rows), LoRA's whole plan is smaller; its adapters' optimizer state is a sliver."""
    wide = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=1"]
    short = ["train.prompts_per_step=8", "train.group_size=8"]
    overrides = ["mesh.data=1", "mesh.fsdp=8", *wide, *short]
    full = plan(load_config(TINY, overrides), prompt_len=8)
    adapted = plan(load_config(TINY, [*overrides, *LORA]), prompt_len=8)
    for name in ("train_step", "train_and_generate"):
        assert adapted[name]["per_device_bytes"] < full[name]["per_device_bytes"], name
    assert adapted["train_step"]["optimizer_state_bytes"] < (
        0.2 * full["train_step"]["optimizer_state_bytes"]
    )
    args = ["memory", "--config", TINY, *[f"--set={o}" for o in [*overrides, *LORA]]]
    assert main(args + ["--prompt-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "frozen base (bfloat16)" in out and "x2: adapters in flight" in out
    assert "LoRA rank 4 (q_proj, k_proj" in out and "LoRA saves" in out


@pytest.mark.parametrize("own", [True, False], ids=["own_devices", "shared_devices"])
def test_lora_generator_holds_one_base_and_adapter_copies(own):
    """The generator decodes with the base in its decoding dtypes (placed once) and two
    adapter copies in flight (pipeline_rl). Beside the trainer it shares the base's buffers
    but for those `for_generation` narrows (here the untied embedding): counted from real
    arrays, by which buffers are new."""
    # The trainer on 4 devices either way (its programs compiled once for both).
    layout = ["pipeline.generator_devices=4", "mesh.fsdp=4"] if own else ["mesh.fsdp=4"]
    cfg = load_config(TINY, [
        "mesh.data=1", *layout, "sampler.slots=16", "model.dtype=bfloat16",
        "model.tie_embeddings=false", "model.num_layers=1", *LORA,
    ])  # fmt: skip
    report = plan(cfg, prompt_len=8)
    gen = report["generate"]
    mesh, gen_mesh = sharding.make_meshes(cfg)
    model = sharding.init_sharded(lambda rngs: Policy(cfg.model, rngs=rngs), gen_mesh or mesh, 0)
    _, frozen, params = lora.split_policy(model, cfg.model)
    base = for_generation(frozen, cfg.model, copy=False)
    adapters = for_generation(params, cfg.model)
    shard = lambda x: x.addressable_shards[0].data.nbytes  # noqa: E731
    assert gen["adapter_bytes"] == sum(shard(x) for x in jax.tree.leaves(adapters))
    assert gen["base_bytes"] == sum(shard(x) for x in jax.tree.leaves(base))
    new = sum(
        shard(g)
        for g, w in zip(jax.tree.leaves(base), jax.tree.leaves(frozen), strict=True)
        if g is not w
    )
    assert new > 0  # the untied embedding, narrowed to bfloat16
    assert gen["parameter_copies"] == 2
    held_base = gen["base_bytes"] if own else new
    assert gen["held_parameters_bytes"] == held_base + 2 * gen["adapter_bytes"]
    assert report["generator"]["parameters_bytes"] == gen["held_parameters_bytes"]


def test_a_peft_adapter_fixes_the_planned_rank_and_targets(tmp_path):
    """`model.lora.init_from`: the plan takes rank and targets from the adapter's config, as
    a run does (only q and v here: A [D, r] and B [r, H E] or [r, K E] per layer)."""
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    lora_from = f"model.lora.init_from={tmp_path}"
    cfg = resolve_model(load_config(TINY, ["mesh.data=8", *LONG, lora_from]))
    assert cfg.model.lora.rank == 2 and cfg.model.lora.projections == ("q_proj", "v_proj")
    mesh, _ = sharding.make_meshes(cfg)
    m = cfg.model
    e = m.resolved_head_dim
    per_layer = 2 * (m.hidden_size + m.num_heads * e) + 2 * (m.hidden_size + m.num_kv_heads * e)
    planned = train_step_memory(cfg, mesh, 8)["lora"]
    assert planned["adapter_bytes"] == 4 * m.num_layers * per_layer


def test_a_packed_plan_compiles_the_packed_step_and_its_token_budget_sets_the_activations(capsys):
    packed = [*SHARDED, "train.packing=true"]
    cfg = load_config(TINY, packed)
    mesh, _ = sharding.make_meshes(cfg)
    part = train_step_memory(cfg, mesh, 8)
    # Rows of 2 x (8 + 64) = 144 positions hold 2 completions at the budget: 8 prompts x 8
    # completions need 32 rows, already a multiple of the 8 batch shards (mesh.fsdp).
    assert part["packed"] == {
        "row_len": 144, "rows": 32, "rows_per_micro_batch": 32, "micro_batches": 1,
    }  # fmt: skip
    budget = [*packed, "train.tokens_per_micro_batch=144"]  # one row per device per micro-step
    small = train_step_memory(load_config(TINY, budget), mesh, 8)
    assert (
        small["packed"]["micro_batches"] == 4
        and small["positions_per_micro_batch_per_shard"] == 144
    )
    assert small["temporaries_bytes"] < 0.5 * part["temporaries_bytes"]
    # packing: auto (the default) plans the padded step it takes for completions at the
    # budget; with a budget below the padded micro-step (8 rows x 72) it always packs.
    auto = train_step_memory(load_config(TINY, SHARDED), mesh, 8)
    assert "packed" not in auto and auto["auto_padded"]
    assert auto["positions_per_micro_batch_per_shard"] == 8 * 72
    auto_budget = [*SHARDED, "train.tokens_per_micro_batch=144"]
    assert train_step_memory(load_config(TINY, auto_budget), mesh, 8)["packed"] == small["packed"]
    # A budget above the padded micro-step: auto may take either. A packed micro-step holds
    # what a batch at the budget fills (32 rows of 144: 4 per device, the padded step's
    # positions), not the budget's 8 rows per device; its packed mask and row arrays cost more
    # than the padded step's, so the plan is packed.
    big = [*SHARDED, "train.tokens_per_micro_batch=1152"]
    larger = train_step_memory(load_config(TINY, big), mesh, 8)
    assert larger["packed"] == part["packed"]
    assert larger["positions_per_micro_batch_per_shard"] == 576
    assert larger["per_device_bytes"] > auto["per_device_bytes"]
    # Too little memory: the advice is a token budget, in whole rows.
    args = ["memory", "--config", TINY, "--device-memory", "0.0001"]
    assert main(args + [f"--set={o}" for o in packed]) == 1
    out = capsys.readouterr().out
    assert "packed (train.packing): 32 rows of 144" in out
    assert "train.tokens_per_micro_batch" in out


def test_an_moe_plan_compiles_the_grouped_matmuls_buffers_on_cpu():
    """On CPUs ragged_dot lowers to dense matmuls over masked copies and the tiled form copies
    an expert's matrices per tile: the plan compiles `moe.experts_scan` instead (a grouped
    matmul's buffers) and says so; its train step holds less than the tiled form's and the
    all-experts reference's."""
    moe = ["model.architecture=qwen3_moe", "model.num_experts=16", "model.num_experts_per_tok=2"]
    moe += ["model.moe_intermediate_size=64", "mesh.data=2", "mesh.expert=4", *LONG]
    report = plan(load_config(TINY, moe))
    assert report["experts"].startswith("auto planned as scan on cpu")
    planned = report["train_step"]["temporaries_bytes"]
    for matmul in ("tiled", "dense"):  # ("ragged" is what the plan stands in for)
        cfg = load_config(TINY, [*moe, f"model.moe_matmul={matmul}"])
        mesh, _ = sharding.make_meshes(cfg)
        other = train_step_memory(cfg, mesh, report["prompt_len"])
        assert other["temporaries_bytes"] > planned


def test_a_multi_turn_plan_on_the_slot_engine_holds_whole_episodes_per_slot():
    """Episodes on the engine: a slot holds its whole episode (the first observation's
    columns and max_episode_tokens more), not one turn after it as a static wave's row, and
    the parked rows beside the slots are planned too."""
    overrides = [*LONG, "mesh.data=1", "sampler.batching=continuous", "sampler.slots=16"]
    overrides += ["task.max_turns=3", "task.max_episode_tokens=96", "task.turn_tokens=16"]
    cfg = load_config(TINY, overrides)
    m = cfg.model
    per_column = (
        2 * m.num_layers * m.num_kv_heads * m.resolved_head_dim * np.dtype(m.dtype).itemsize
    )
    gen = plan(cfg)["generate"]
    assert gen["kv_cache_bytes"] == 16 * (96 + 96) * per_column
    # Parked rows (sampler.parked_rows -1: as many as the slots) hold as much again.
    assert gen["parked_rows"] == 16 and gen["parked_rows_bytes"] == gen["decode_state_bytes"]
    # With the prompt columns set (a longer first observation fed as given), only those.
    sized = plan(load_config(TINY, [*overrides, "task.prompt_tokens=12"]))["generate"]
    assert sized["kv_cache_bytes"] == 16 * (12 + 96) * per_column


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_dense_models_prompts_run_without_a_stacked_copy_of_the_weights(batching):
    """The programs that start rows (a wave's prefill, the engine's admission) on a
    data-parallel generator, whose devices each hold the whole model: with `scan_layers` a
    scan would take the layers' weights as one stacked copy, a copy of the model on every
    device (27 GiB of the 8B recipe's admission as the planner compiles it). Four more layers
    add far less than their weights."""
    from jaxrl_scale.memory.generator import prefill_memory

    def temporaries(layers):
        cfg = load_config(TINY, [
            "model.hidden_size=256", "model.intermediate_size=1024", f"model.num_layers={layers}",
            "model.scan_layers=true", "mesh.data=4", "sampler.max_new_tokens=8",
            "train.prompts_per_step=4", "train.group_size=4", "sampler.slots=16",
            f"sampler.batching={batching}",
        ])  # fmt: skip
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:4])
        return prefill_memory(cfg, mesh, 8, copy=True)["temporaries_bytes"]

    d, f = 256, 1024
    per_layer = 4 * (4 * d * d + 3 * d * f)  # float32: attention (at most) and the MLP
    assert temporaries(6) - temporaries(2) < 4 * per_layer / 4


def test_scored_batches_wait_on_the_host_and_the_plan_counts_them():
    """Up to k batches wait for the trainer, and it trains one: k + 1 on the host (never on
    the trainer's devices), each with router replay's experts at every position (one byte
    per id up to 256 experts), by hand."""
    moe = ["model.architecture=qwen3_moe", "model.qk_norm=true", "model.num_experts=8",
           "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
           "model.router_replay=true", "model.num_layers=2", "model.qkv_bias=false",
           "pipeline.max_staleness=4"]  # fmt: skip
    cfg = load_config(TINY, [*LONG, *moe])
    from jaxrl_scale.memory.plan import host_batches

    got = host_batches(cfg, prompt_len=8)
    rows, length, n = 64, 8, 64  # 8 prompts x 8; LONG's 64 new tokens
    plain = rows * (length * (4 + 1) + n * (4 + 1 + 4 + 4) + 4)
    routes = rows * (length + n) * 2 * 2  # 2 routed layers x top-2, uint8
    assert got == {"batch_bytes": plain + routes, "routes_bytes": routes, "batches": 5,
                   "host_bytes": 5 * (plain + routes)}  # fmt: skip
    sync = host_batches(load_config(TINY, [*LONG, "pipeline.mode=sync"]), prompt_len=8)
    assert sync["batches"] == 1 and sync["routes_bytes"] == 0
