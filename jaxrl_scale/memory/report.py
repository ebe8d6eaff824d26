"""The plan as a person reads it: the per-device table, verdicts and advice on what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxrl_scale.memory.abstract import GIB

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


def advice(name: str, part: dict[str, Any], cfg: ExperimentConfig, report) -> str:
    m = cfg.model
    packed = "packed" in report["train_step"]  # train.packing: true, or auto always packing
    micro = "train.tokens_per_micro_batch" if packed else "train.micro_batches"
    if name == "train_and_generate":
        run = "run at once" if part["concurrent"] else "keep the train state while generating"
        return (
            f"the train step and the generator share these devices and {run}: give the "
            "generator its own (pipeline.generator_devices), or shrink either side "
            f"(generator: {_generator_advice(report['generator'], report, cfg)}; train step: "
            f"{micro}, model.remat)"
        )
    if name == "generator":
        return _generator_advice(part, report, cfg)
    if name == "weight_transfer":
        return (
            "the train state, the weights cast for the generator and the largest leaf on its "
            "way to the generator's devices do not fit: more trainer devices (mesh.fsdp), or "
            "the generators as jobs of their own (hosts.generator_groups)"
        )
    if name == "trainer_host":
        return (
            "the train step and the versions kept for the generators (or a version being laid "
            "out beside them and the train state) do not fit: more trainer "
            f"devices (mesh.fsdp), {micro}, model.remat"
        )
    state = part["parameters_bytes"] + part["optimizer_state_bytes"]
    if state >= part["temporaries_bytes"]:
        if not m.lora.enabled:
            also = "or train low-rank adapters alone (model.lora.rank)"
        elif m.lora.base_dtype == "float32":
            also = "or keep the frozen base in bfloat16 (model.lora.base_dtype)"
        else:
            also = "or a smaller model"
        return (
            f"parameters + optimizer state ({_gib(state)} per device) are the biggest term: "
            f"shard them over more devices (mesh.fsdp, now {cfg.mesh.fsdp}) {also}"
        )
    if "packed" in part:
        knobs = [_packed_budget(part, report)]
    else:
        knobs = [f"more train.micro_batches (now {cfg.train.micro_batches})"]
        if part.get("auto_padded"):
            knobs.append(
                "train.tokens_per_micro_batch below "
                f"{part['positions_per_micro_batch_per_shard']:,} (packing: auto then always "
                "packs, in micro-steps of that many positions)"
            )
    if m.remat != "full" or not m.scan_layers:
        # Measured: remat pays off inside the scanned layers (each layer one checkpoint).
        knobs.append(
            f"model.remat=full with model.scan_layers=true (now {m.remat}, {m.scan_layers})"
        )
    if m.attention == "xla":
        knobs.append("model.attention=auto (stored scores grow as T^2)")
    knobs.append(f"a smaller model.logits_chunk_size (now {m.logits_chunk_size})")
    return (
        f"temporaries (activations and gradients, {_gib(part['temporaries_bytes'])} per device, "
        f"{part['rows_per_micro_batch']} rows per micro-batch) are the biggest term; what "
        "shrinks them: " + ", ".join(knobs)
    )


def _packed_budget(part: dict[str, Any], report) -> str:
    """A packed step's token budget that would fit: the temporaries scaled with the positions
    per micro-step (about linear; the parameters and optimizer state stay)."""
    now = part["positions_per_micro_batch_per_shard"]
    room = report["pool_bytes"] - (part["per_device_bytes"] - part["temporaries_bytes"])
    row = part["packed"]["row_len"]
    fits = now * room // max(part["temporaries_bytes"], 1) // row * row
    if fits < row:
        return (
            f"not even one packed row of {row:,} per micro-step fits beside the state: a "
            "shorter train.pack_length or less state per device"
        )
    return (
        f"a smaller train.tokens_per_micro_batch (now {now:,} positions per batch shard per "
        f"micro-step; about {fits:,} would fit, the temporaries scaled with the positions)"
    )


def _generator_advice(part: dict[str, Any], report, cfg: ExperimentConfig) -> str:
    """The generator devices' biggest term and what shrinks it."""
    ev, gen = report["evaluate"], report["generate"]
    terms = {
        "parameter copies": part["parameters_bytes"],
        "decode state": part["decode_state_bytes"],
        "working memory": part["working_bytes"],
        "evaluation": part["evaluation_bytes"],
    }
    biggest = max(terms, key=terms.get)
    size = _gib(terms[biggest])
    if biggest == "evaluation":
        return (
            f"held-out evaluation ({size}: {ev['rows_per_wave']} rows per wave) is the biggest "
            f"term: fewer rows per wave (sampler.slots, now {cfg.sampler.slots}, bounds a wave; "
            f"train.eval_samples, now {cfg.train.eval_samples}) or more generator devices"
        )
    if biggest == "parameter copies":
        return (
            f"the parameter copies ({size}, {gen['parameter_copies']} of them) are the biggest "
            "term: split the generator's weights (mesh.tensor) or use a bf16 model.dtype"
        )
    return (
        f"the {biggest} ({size}; the KV cache of {gen['slots']} slots is "
        f"{_gib(gen['kv_cache_bytes'])}) is the biggest term: fewer rows in flight "
        f"(sampler.slots, now {cfg.sampler.slots or gen['slots']}) or more generator devices "
        "(pipeline.generator_devices, or a larger batch axis of the mesh)"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def format_plan(report: dict[str, Any]) -> str:
    lines = [
        f"sequence length {report['sequence_length']:,} tokens "
        f"(prompt {report['prompt_len']:,} [{report['prompt_len_from']}] + max_new_tokens "
        f"{report['max_new_tokens']:,})",
        f"attention: {report['attention']}",
    ]
    n = report.get("processes", 1)
    where = f"planned as {n} trainer process{'es' if n > 1 else ''} (--processes: its hosts)"
    if "trainer_host" in report:
        where += ", and each generator group as one process on a host like this one"
    lines.append(where)
    if "experts" in report:
        lines.append(f"experts: {report['experts']}")
    titles = {
        "train_step": ("train step", report["train_mesh"]),
        "generate": ("generate (one decode chunk)", report["generate_mesh"]),
    }
    for name, (title, mesh) in titles.items():
        part = report[name]
        axes = " ".join(f"{k}={v}" for k, v in mesh.items())
        lines.append(f"\n{title}, mesh {axes}, per device:")
        rows = [("parameters", part["parameters_bytes"])]
        if "lora" in part:
            adapted = part["lora"]
            rows += [
                (f"  frozen base ({adapted['base_dtype']})", adapted["frozen_base_bytes"]),
                ("  adapters (float32)", adapted["adapter_bytes"]),
            ]
        elif "adapter_bytes" in part:
            rows += [("  base", part["base_bytes"]), ("  adapters", part["adapter_bytes"])]
        if part.get("parameter_copies", 1) > 1:
            n = part["parameter_copies"]
            what = "adapters" if "adapter_bytes" in part else "weights"
            rows.append((f"  x{n}: {what} in flight", n * part["update_bytes"]))
        if name == "train_step":
            rows += [
                ("optimizer state", part["optimizer_state_bytes"]),
                ("all arguments (+ batch)", part["arguments_bytes"]),
            ]
        else:
            rows += [
                ("KV cache", part["kv_cache_bytes"]),
                ("all arguments (+ rows)", part["arguments_bytes"]),
            ]
        rows += [
            ("temporaries", part["temporaries_bytes"]),
            ("outputs (not aliased)", part["outputs_bytes"]),
            ("total", part["per_device_bytes"]),
        ]
        lines += _table(rows)
        if "packed" in part:
            pk, per_shard = part["packed"], part["positions_per_micro_batch_per_shard"]
            lines.append(
                f"  packed (train.packing): {pk['rows']} rows of {pk['row_len']:,} (every "
                f"completion at the budget), {pk['micro_batches']} micro-step"
                f"{'s' if pk['micro_batches'] != 1 else ''} of "
                f"{pk['rows_per_micro_batch']} rows, {per_shard:,} positions per batch shard each"
            )
        if part.get("auto_padded"):
            lines.append(
                "  train.packing: auto, planned padded: the layout auto takes for a batch whose "
                "completions all run to the budget"
            )
        if "temporaries_bytes_as_compiled" in part:
            lines.append(
                "  temporaries: the smaller of two upper bounds, bf16 as the CPU compiles it "
                f"({_gib(part['temporaries_bytes_as_compiled'])}, float32 copies of matmul "
                f"operands) and the float32 program "
                f"({_gib(part['temporaries_bytes_float32_program'])})"
            )
    if "lora" in report["train_step"]:
        lines += _lora_lines(report["train_step"]["lora"])
    first, ev, gen = report["prefill"], report["evaluate"], report["generator"]
    lines.append(f"\n{first['program']}: {_gib(first['extra_bytes'])} per device beyond the "
                 "parameters and the slots' state")  # fmt: skip
    between = gen.get("evaluation_between_batches", False)  # a generator job's
    where = "between its batches, in a batch's place" if between else "beside the generator"
    lines.append(
        f"held-out evaluation: {ev['waves']} wave(s) of {ev['rows_per_wave']} rows, "
        f"{_gib(ev['per_device_bytes'])} per device {where}"
    )
    lines.append("\nthe generator's devices hold at once, per device:")
    lines += _table([
        ("parameter copies", gen["parameters_bytes"]),
        ("decode state (KV cache, rows)", gen["decode_state_bytes"]),
        (f"working ({gen['working_program']})", gen["working_bytes"]),
        ("held-out evaluation" + (" (beyond a batch's)" if between else ""),
         gen["evaluation_bytes"]),
        ("total", gen["per_device_bytes"]),
    ])  # fmt: skip
    if "pool_bytes" in report:
        lines.append(
            f"\nmemory pool: {_gib(report['pool_bytes'])} per device = "
            f"{_gib(report['device_memory_bytes'])} x {report['mem_fraction']:g} (JAX takes "
            "XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU, 0.75 unless set; --mem-fraction plans "
            "another, 1 for a TPU)"
        )
    verdicts = {"train_step": "train step", "generator": "generator's devices"}
    if "trainer_host" in report:
        part = report["trainer_host"]
        lines.append("\nthe trainer's devices hold, per device (generators are jobs of their own, "
                     "and make its held-out evaluations):")  # fmt: skip
        lines += _table([
            ("train step", part["train_step_bytes"]),
            ("versions held for the generators", part["held_versions_bytes"]),
            ("or, publishing a version", part["publish_bytes"]),
            ("  (its layout's temporaries)", part["layout_temporaries_bytes"]),
            ("total", part["per_device_bytes"]),
        ])  # fmt: skip
        verdicts = {"trainer_host": "trainer's devices", "generator": "a generator group's"}
    if "weight_transfer" in report:
        part = report["weight_transfer"]
        lines.append(
            f"\nthe trainer's devices while weights move to the generator across "
            f"{report['processes']} processes, per device:"
        )
        lines += _table([
            ("train state", part["per_device_bytes"] - part["cast_weights_bytes"]
             - part["staged_leaf_bytes"]),
            ("weights cast for the generator", part["cast_weights_bytes"]),
            ("one leaf in flight (the largest)", part["staged_leaf_bytes"]),
            ("total", part["per_device_bytes"]),
        ])  # fmt: skip
        verdicts["weight_transfer"] = "weight transfer"
    if "train_and_generate" in report:
        part = report["train_and_generate"]
        how = "at once" if part["concurrent"] else "with the train state resident"
        lines.append(f"\ntrain step + generator on the same devices ({how}): "
                     f"{_gib(part['per_device_bytes'])} per device")  # fmt: skip
        verdicts = {"train_step": "train step", "train_and_generate": "train + generator"}
    if "host_batches" in report:
        part = report["host_batches"]
        routes = part["routes_bytes"]
        experts = f", {_gib(routes)} of it router replay's experts" if routes else ""
        lines.append(
            f"\nscored batches wait on the trainer's host, not its devices: up to "
            f"{part['batches']} (k + 1) of {_gib(part['batch_bytes'])}{experts}: "
            f"{_gib(part['host_bytes'])} of host memory"
        )
    for name, title in verdicts.items():
        part = report[name]
        if "fits" in part:
            verdict = "yes" if part["fits"] else "NO"
            lines.append(f"  {title}: {_gib(part['per_device_bytes'])}, fits: {verdict}")
            if not part["fits"]:
                lines.append(f"    {part['advice']}")
    return "\n".join(lines)


def _lora_lines(part: dict[str, Any]) -> list[str]:
    """LoRA's resident train state per device beside full fine-tuning's."""
    full = part["full_fine_tuning"]
    lines = [
        f"\nLoRA rank {part['rank']} ({', '.join(part['targets'])}), base {part['base_dtype']}:",
        "  resident train state per device against full fine-tuning (float32) on this mesh",
    ]
    lines.append(f"  {'':<32}{'LoRA':>12}{'full':>12}")
    for label, key in [
        ("parameters", "parameters_bytes"),
        ("gradients", "gradient_bytes"),
        ("optimizer state", "optimizer_state_bytes"),
        ("total", "state_bytes"),
    ]:
        lines.append(f"  {label:<32}{_gib(part[key]):>12}{_gib(full[key]):>12}")
    lines.append(f"  LoRA saves {_gib(part['saving_bytes'])} per device")
    return lines


def _table(rows) -> list[str]:
    return [f"  {label:<32}{_gib(n):>12}" for label, n in rows]
