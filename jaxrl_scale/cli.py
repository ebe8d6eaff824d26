"""`jaxrl-scale` command line: parse arguments, build the config, call one function."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jaxrl_scale.config import load_config
from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.fit.config import ForecastConfig
from jaxrl_scale.fit.data import CurveDataError

DEMO_CONFIG = "asset:demo.yaml"  # shipped inside the package (jaxrl_scale/assets/demo.yaml)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl-scale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="a few minutes of RL on a CPU, then the run's fitted curve with intervals"
    )
    demo.add_argument("--config", default=DEMO_CONFIG, help=f"YAML config (default: {DEMO_CONFIG})")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument(
        "--from-scratch",
        action="store_true",
        help="warm-start the policy here (about 6 more minutes) instead of loading the shipped one",
    )

    train = sub.add_parser("train", help="RL training from a YAML config")
    train.add_argument(
        "--config", required=True, help="YAML file, asset:NAME, or a run's RUN/config.yaml"
    )
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    train.add_argument("--out", type=Path, required=True, help="run directory")
    train.add_argument(
        "--no-resume", action="store_true", help="ignore checkpoints already in --out"
    )
    train.add_argument(
        "--init-from",
        default=None,
        metavar="HF_DIR",
        help="start from this Hugging Face folder (sets model.init_from)",
    )
    train.add_argument(
        "--adapter-from",
        default=None,
        metavar="PEFT_DIR",
        help="start LoRA from this PEFT adapter folder (sets model.lora.init_from)",
    )
    train.add_argument(
        "--role",
        choices=("trainer", "generator"),
        default=None,
        help="with hosts.generator_groups > 0: this process trains, or generates as a group "
        "(default: JAXRL_ROLE, else trainer)",
    )
    train.add_argument(
        "--group", type=int, default=None, help="generator group number (default: JAXRL_GROUP)"
    )

    sweep = sub.add_parser(
        "sweep", help="run configs x seeds, fit each, compare the configs (resumable)"
    )
    sweep.add_argument("configs", nargs="+", type=Path, metavar="CONFIG")
    sweep.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    sweep.add_argument("--out", type=Path, default=Path("runs/study"))
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    sweep.add_argument("--margin", type=float, default=0.02, help="A difference below which tie")
    sweep.add_argument("--bootstrap", type=int, default=1000, metavar="N", help="resamples")
    sweep.add_argument(
        "--refit", action="store_true", help="fit finished runs again from their metrics"
    )

    export = sub.add_parser(
        "export",
        help="a run's newest checkpoint as a Hugging Face folder (LoRA merged), and a LoRA "
        "run's adapters as a PEFT folder",
    )
    export.add_argument("run", type=Path, metavar="RUN", help="run directory")
    export.add_argument("--out", type=Path, required=True, help="Hugging Face folder to write")
    export.add_argument("--peft", type=Path, default=None, metavar="DIR",
                        help="also write the adapters as a PEFT folder")  # fmt: skip

    memory = sub.add_parser(
        "memory",
        help="per-device memory of a config's train step and decode step, compiled from shapes",
    )
    memory.add_argument("--config", required=True, help="YAML file or asset:NAME")
    memory.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    memory.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens per row (default: measured for procedural tasks, 1024 for math); "
        "the sequence is N + sampler.max_new_tokens",
    )
    memory.add_argument(
        "--device-memory", type=float, default=None, metavar="GIB", help="say whether it fits"
    )
    memory.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the share of --device-memory JAX's pool gets (default: "
        "XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75 as JAX preallocates on a GPU; 1 for a TPU)",
    )
    memory.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="the processes (hosts) the trainer's job spans: the devices are split into N "
        "blocks, each planned as one process's (default 1)",
    )
    memory.add_argument("--json", action="store_true", help="print one JSON object")

    serve = sub.add_parser(
        "serve", help="serve a checkpoint with the OpenAI HTTP API (docs/serving.md)"
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--init-from", default=None, metavar="HF_DIR", help="a Hugging Face folder (or asset:NAME)"
    )
    source.add_argument(
        "--run",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="a run directory: its newest checkpoint, LoRA merged",
    )
    source.add_argument(
        "--config",
        default=None,
        dest="serve_config",  # optional here: other commands' args.config is a required file
        help="a config whose model.init_from to serve",
    )
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (logged)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on /v1 (default: JAXRL_API_KEY)",
    )
    serve.add_argument(
        "--allow-remote-without-key",
        action="store_true",
        help="bind a non-loopback --host without an API key",
    )
    serve.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        help="rows decoding at once (default: --config's sampler.slots, else 16)",
    )
    serve.add_argument(
        "--context",
        type=_positive_int,
        default=4096,
        help="most prompt + generated tokens of a request (default 4096)",
    )
    serve.add_argument(
        "--max-queue",
        type=_positive_int,
        default=64,
        help="requests waiting for slots before 429 (default 64)",
    )
    serve.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="serve at once, compiling each program at its first request (default: compile "
        "every one before serving)",
    )
    serve.add_argument(
        "--http-in-process",
        action="store_true",
        help="run the HTTP server on a thread of the engine's process (default: a process of "
        "its own, so that the two do not share one interpreter lock)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model id clients send (default: the folder's name)",
    )

    fit = sub.add_parser("fit", help="fit scaling curves to CSV / JSONL files or run directories")
    fit.add_argument("files", nargs="+", type=Path, metavar="FILE")
    fit.add_argument("--x", default="compute_flops", help="compute column (default compute_flops)")
    fit.add_argument("--y", default="eval_pass_rate", help="reward column (default eval_pass_rate)")
    fit.add_argument("--r0", type=float, default=None, help="hold R0 at this value")
    fit.add_argument("--c-min", type=float, default=None, help="drop points with compute below")
    fit.add_argument(
        "--c-min-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="leave out early points below F x the last fitted compute (early transients; "
        f"the online forecast uses {ForecastConfig.c_min_fraction} for evals at equal step "
        "intervals; on a geometric compute grid a fraction drops far more points)",
    )
    fit.add_argument(
        "--fit-until",
        type=float,
        default=None,
        metavar="F",
        help="fit points up to F x the last compute (0 < F < 1), forecast the last point",
    )
    fit.add_argument("--predict-at", type=float, default=None, metavar="C")
    fit.add_argument("--bootstrap", type=int, default=2000, metavar="N", help="resamples")
    fit.add_argument("--a-max", type=float, default=1.0, help="upper bound on A and rewards")
    fit.add_argument("--margin", type=float, default=0.02, help="A difference below which runs tie")
    fit.add_argument(
        "--eval-size",
        "--eval-n",
        dest="eval_size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="problems in the eval set: its binomial sampling noise sharpens the intervals "
        "(a file's eval_sampling_sd column, which runs of this trainer log, is used by itself)",
    )
    fit.add_argument("--plot", type=Path, default=None, metavar="PNG")
    fit.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fit(args) -> None:
    import json
    import warnings

    from jaxrl_scale.fit.report import fit_files, format_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fit_files(
            args.files,
            x=args.x,
            y=args.y,
            r0=args.r0,
            c_min=args.c_min,
            c_min_fraction=args.c_min_fraction,
            fit_until=args.fit_until,
            predict_at=args.predict_at,
            n_boot=args.bootstrap,
            a_max=args.a_max,
            margin=args.margin,
            plot=args.plot,
            eval_size=args.eval_size,
        )
    for w in caught:
        if issubclass(w.category, UserWarning) and "JAXopt" not in str(w.message):
            print(f"warning: {w.message}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_report(report))


def _memory(args) -> int:
    import json
    import time

    from jaxrl_scale.memory import format_plan, plan, resolve_model

    cfg = resolve_model(load_config(args.config, args.overrides))
    started = time.perf_counter()

    def say(text: str) -> None:  # on stderr: --json keeps stdout to the report
        print(f"[{time.perf_counter() - started:5.1f} s] {text}", file=sys.stderr, flush=True)

    say(f"planning {args.config} from shapes (nothing is allocated)")
    report = plan(
        cfg,
        prompt_len=args.prompt_len,
        device_memory_gib=args.device_memory,
        mem_fraction=args.mem_fraction,
        processes=args.processes,
        say=say,
    )
    say("done")
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0 if report.get("fits", True) else 1


def _serve(args) -> int:
    from jaxrl_scale.serving import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from jaxrl_scale.demo import run_demo

            cfg = load_config(args.config, args.overrides)
            run_demo(cfg, args.out, from_scratch=args.from_scratch)
        elif args.command == "train":
            from jaxrl_scale.parallel.distributed import is_main
            from jaxrl_scale.train import train

            overrides = list(args.overrides)
            if args.init_from:
                overrides.append(f"model.init_from={args.init_from}")
            if args.adapter_from:
                overrides.append(f"model.lora.init_from={args.adapter_from}")
            role = args.role or os.environ.get("JAXRL_ROLE") or "trainer"
            if role == "generator":
                from jaxrl_scale.hosts.generator_job import main as generate

                group = args.group if args.group is not None else os.environ.get("JAXRL_GROUP")
                return generate(load_config(args.config, overrides), int(group or 0))
            if role != "trainer":
                raise ConfigError(f"--role / JAXRL_ROLE: {role!r} is not trainer or generator")
            rows = train(load_config(args.config, overrides), args.out, resume=not args.no_resume)
            if not is_main():  # across processes, process 0 reports
                return 0
            last = next((r for r in reversed(rows) if "eval_pass_rate" in r), None)
            if last is not None:
                print(f"step {last['step']}: held-out pass rate {last['eval_pass_rate']:.3f}")
            print(f"run directory: {args.out} (metrics.jsonl, tensorboard/, checkpoints/)")
        elif args.command == "sweep":
            from jaxrl_scale.sweep import format_study, run_sweep

            study = run_sweep(
                args.configs,
                args.out,
                seeds=args.seeds,
                overrides=args.overrides,
                margin=args.margin,
                n_boot=args.bootstrap,
                refit=args.refit,
            )
            print(format_study(study))
            print(f"\nwrote {args.out / 'study.json'}, {args.out / 'study.md'}, {study['plot']}")
        elif args.command == "fit":
            _fit(args)
        elif args.command == "memory":
            return _memory(args)
        elif args.command == "serve":
            return _serve(args)
        elif args.command == "export":
            from jaxrl_scale.train import export_run

            for path in export_run(args.run, args.out, peft_out=args.peft):
                print(f"wrote {path}")
    except ConfigError as e:
        print(f"jaxrl-scale: config error: {e}", file=sys.stderr)
        return 2
    except (CurveDataError, ValueError, FileNotFoundError) as e:
        print(f"jaxrl-scale: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
