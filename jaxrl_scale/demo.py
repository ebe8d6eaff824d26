"""The CPU demo: RL with the ScaleRL recipe on arithmetic, then the run's fitted curve.

    jaxrl-scale demo [--out runs/demo] [--from-scratch]

1. Start from a tiny policy (0.4M parameters) that was warm-started on *imperfect*
   demonstrations (half of them have the last digit off by one): it knows most answers but
   puts only about half its probability on them. That is what RL does best in real
   post-training: concentrate probability on answers the model can already produce. The policy
   ships in `jaxrl_scale/assets/demo_policy` (`model.init_from: asset:demo_policy`) and
   `scripts/make_demo_policy.py` rebuilds it (`--from-scratch` runs that warm start here
   first, about 6 more minutes).
2. Train with CISPO, PipelineRL-8, prompt aggregation, batch normalisation, zero-variance
   filtering, No-Positive-Resampling and the FP32 head (jaxrl_scale/assets/demo.yaml, shipped
   in the package: `--config asset:demo.yaml`), evaluating the
   held-out split every few steps; the online forecast refits the curve as it goes.
3. Fit the sigmoid to the whole eval curve (R0 = the eval before RL) with bootstrap intervals,
   and check the fit made at half the run against where the run ended.

Writes into the run directory: metrics.jsonl, tensorboard/, fit.png, fit.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_scale.config import ExperimentConfig
from jaxrl_scale.fit import Curve
from jaxrl_scale.fit.plot import plot_fits
from jaxrl_scale.fit.report import fit_run

N_BOOT = 2000
WARM_START_STEPS = 8000  # supervised steps behind the shipped policy (asset:demo_policy)


def summarise(
    rows: list[dict[str, Any]], out: Path, *, x: str = "compute_flops", **extra: Any
) -> dict:
    """Final fit, half-run forecast, fit.png and fit.json (with `extra` fields) for a finished
    run's metrics rows."""
    run = fit_run(rows, x=x, n_boot=N_BOOT)
    summary = {"x": x, **run.summary(), **extra}
    entries = [(Curve("demo run", run.compute, run.rate, r0=run.r0), run.final, None)]
    if run.half is not None:
        early = run.compute <= run.half.c_cut
        half_curve = Curve("fit at half the run", run.compute[early], run.rate[early], r0=run.r0)
        entries.append((half_curve, run.half.boot, run.half.c_cut))
    summary["plot"] = str(
        plot_fits(entries, out / "fit.png", xlabel=f"{x} (RL)", ylabel="held-out pass rate")
    )
    (out / "fit.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(s: dict) -> str:
    a_lo, a_hi = s["a_ci"]
    h = s["half_run"]
    rows = [
        ("pass rate before RL (R0)", f"{s['r0']:.3f}"),
        ("pass rate at the end", f"{s['final_pass_rate']:.3f}  (gain {s['gain']:+.3f})"),
        (
            "fitted ceiling A [95%]",
            f"{s['a']:.3f} [{a_lo:.3f}, {a_hi:.3f}]  (width {a_hi - a_lo:.3f})",
        ),
        ("efficiency B", f"{s['b']:.2f}"),
        ("C_mid", f"{s['c_mid']:.3g} {s['x']}"),
    ]
    if h is not None:
        rows.append(
            (
                "fit at half the run said",
                f"{h['predicted_final']:.3f} [{h['interval'][0]:.3f}, {h['interval'][1]:.3f}] "
                f"for the end; it reached {h['actual_final']:.3f} (off by {abs(h['error']):.3f})",
            )
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if s.get("held_level", {}).get("holds"):
        lines.append("  warning: the evals hold a level with no rise; A is not pinned down")
    elif not s["identifiable"]:
        lines.append("  warning: the curve did not pass its inflection; A is not pinned down")
    return "\n".join(lines)


def make_demo_policy(cfg: ExperimentConfig, out: Path, steps: int = WARM_START_STEPS) -> Path:
    """The supervised warm start behind the shipped demo policy: `steps` steps on the task's
    (noisy) demonstrations from a random init (the config's `warm_start` settings), saved as a
    Hugging Face folder at `out`."""
    from flax import nnx

    from jaxrl_scale.models.hf import save_pretrained
    from jaxrl_scale.models.policy import Policy
    from jaxrl_scale.rl.warm_start import warm_start
    from jaxrl_scale.tasks import make_task

    model_cfg = dataclasses.replace(cfg.model, init_from=None)
    graphdef, params = nnx.split(Policy(model_cfg, rngs=nnx.Rngs(params=cfg.seed)))
    task = make_task(cfg.task, seed=cfg.seed)
    settings = dataclasses.replace(cfg.warm_start, steps=steps, target_loss=0.0)
    start = time.perf_counter()
    params, losses = warm_start(params, graphdef, task, settings, seed=cfg.seed)
    print(
        f"warm start: {len(losses)} steps in {time.perf_counter() - start:.0f} s, "
        f"demonstration loss {np.mean(losses[-50:]):.3f}"
    )
    return save_pretrained(nnx.merge(graphdef, params), task.tokenizer, out)


def run_demo(cfg: ExperimentConfig, out: Path, *, from_scratch: bool = False) -> dict:
    from jaxrl_scale.train import train

    out = Path(out)
    if from_scratch:
        policy = make_demo_policy(cfg, out / "policy", WARM_START_STEPS)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(policy)))
    print(f"policy: {cfg.model.init_from or 'random init'}")
    start = time.perf_counter()
    rows = train(cfg, out, resume=False)
    train_s = time.perf_counter() - start
    print(f"\nRL: {rows[-1]['step']} steps in {train_s:.0f} s; fitting the eval curve ...")
    summary = summarise(rows, out, x=cfg.forecast.x, train_seconds=train_s)
    print(format_summary(summary))
    print(f"\nrun directory: {out}")
    for name in ("metrics.jsonl", "tensorboard", "fit.png", "fit.json"):
        print(f"  {out / name}")
    return summary
