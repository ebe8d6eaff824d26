"""The CPU demo: RL with the ScaleRL recipe on arithmetic, then the run's fitted curve.

    jaxrl-scale demo [--out runs/demo] [--from-scratch]

1. Start from a tiny policy (0.4M parameters) that was warm-started on *imperfect*
   demonstrations (half of them have the last digit off by one): it knows most answers but
   puts only about half its probability on them. That is what RL does best in real
   post-training: concentrate probability on answers the model can already produce. The policy
   ships in `jaxrl_scale/assets/demo_policy` and `scripts/make_demo_policy.py` rebuilds it
   (`--from-scratch` runs that warm start here first, about 6 more minutes).
2. Train with CISPO, PipelineRL-8, prompt aggregation, batch normalisation, zero-variance
   filtering, No-Positive-Resampling and the FP32 head (configs/demo.yaml), evaluating the
   held-out split every few steps; the online forecast refits the curve as it goes.
3. Fit the sigmoid to the whole eval curve (R0 = the eval before RL) with bootstrap intervals,
   and check the fit made at half the run against where the run ended.

Writes into the run directory: metrics.jsonl, tensorboard/, fit.png, fit.json.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_scale.config import ExperimentConfig
from jaxrl_scale.fit import Curve, bootstrap_sigmoid, extrapolation_check
from jaxrl_scale.fit.plot import plot_fits

DEMO_POLICY = Path(__file__).resolve().parent / "assets" / "demo_policy"
N_BOOT = 2000


def eval_curve(rows: list[dict[str, Any]], x: str = "compute_flops"):
    """(R0, compute [P], pass rate [P]) from metrics rows: R0 is the step-0 evaluation."""
    evals = [r for r in rows if r.get("eval_pass_rate") is not None]
    r0 = next(r["eval_pass_rate"] for r in evals if r["step"] == 0)
    later = [r for r in evals if r["step"] > 0]
    return (
        r0,
        np.array([r[x] for r in later], float),
        np.array([r["eval_pass_rate"] for r in later]),
    )


def summarise(rows: list[dict[str, Any]], out: Path, *, x: str = "compute_flops") -> dict:
    """Final fit, half-run forecast, fit.png and fit.json for a finished run's metrics rows."""
    r0, compute, rate = eval_curve(rows, x)
    final = bootstrap_sigmoid(compute, rate, n=N_BOOT, r0=r0)
    half = extrapolation_check(compute, rate, fit_until=0.5, n_boot=N_BOOT, r0=r0)
    fit = final.fit
    summary = {
        "x": x,
        "r0": r0,
        "start_pass_rate": r0,
        "final_pass_rate": float(rate[-1]),
        "gain": float(rate[-1] - r0),
        "a": float(fit.a),
        "a_ci": list(final.ci["a"]),
        "b": float(fit.b),
        "b_ci": list(final.ci["b"]),
        "c_mid": float(fit.c_mid),
        "c_mid_ci": list(final.ci["c_mid"]),
        "identifiable": final.identifiable,
        "half_run": {
            "points_fitted": half.n_fit,
            "c_cut": half.c_cut,
            "a": float(half.boot.fit.a),
            "a_ci": list(half.boot.ci["a"]),
            "predicted_final": half.predicted,
            "interval": [half.lo, half.hi],
            "actual_final": half.actual,
            "error": half.error,
            "covered": half.covered,
        },
    }
    curve = Curve("demo run", compute, rate)
    keep = compute <= half.c_cut
    early = Curve("fit at half the run", compute[keep], rate[keep])
    entries = [
        (curve, final, None),
        (dataclasses.replace(early, compute=compute, reward=rate), half.boot, half.c_cut),
    ]
    summary["plot"] = str(
        plot_fits(
            entries, out / "fit.png", xlabel=f"{x} (RL)", ylabel="held-out pass rate (mean@k)"
        )
    )
    (out / "fit.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_summary(s: dict) -> str:
    a_lo, a_hi = s["a_ci"]
    h = s["half_run"]
    rows = [
        ("pass rate before RL (R0)", f"{s['start_pass_rate']:.3f}"),
        ("pass rate at the end", f"{s['final_pass_rate']:.3f}  (gain {s['gain']:+.3f})"),
        (
            "fitted ceiling A [95%]",
            f"{s['a']:.3f} [{a_lo:.3f}, {a_hi:.3f}]  (width {a_hi - a_lo:.3f})",
        ),
        ("efficiency B", f"{s['b']:.2f}"),
        ("C_mid", f"{s['c_mid']:.3g} {s['x']}"),
        (
            "fit at half the run said",
            f"{h['predicted_final']:.3f} [{h['interval'][0]:.3f}, {h['interval'][1]:.3f}] "
            f"for the end; it reached {h['actual_final']:.3f} (off by {abs(h['error']):.3f})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if not s["identifiable"]:
        lines.append("  warning: the curve did not pass its inflection; A is not pinned down")
    return "\n".join(lines)


def make_demo_policy(cfg: ExperimentConfig, out: Path) -> Path:
    """The supervised warm start behind the shipped demo policy: `train.sft_steps` steps on the
    task's (noisy) demonstrations from a random init, saved as a Hugging Face folder at `out`."""
    from flax import nnx

    from jaxrl_scale.hf import save_pretrained
    from jaxrl_scale.train import Trainer

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None))
    with tempfile.TemporaryDirectory() as scratch:  # the trainer's run files are not kept
        trainer = Trainer(cfg, scratch, resume=False)
        start = time.perf_counter()
        losses = trainer.supervised_warm_start()
        print(
            f"warm start: {len(losses)} steps in {time.perf_counter() - start:.0f} s, "
            f"demonstration loss {np.mean(losses[-50:]):.3f}"
        )
        model = nnx.merge(trainer.graphdef, trainer.state.params)
        trainer.metrics.close()
        trainer.checkpointer.close()
    return save_pretrained(model, trainer.tok, out)


def run_demo(cfg: ExperimentConfig, out: Path, *, from_scratch: bool = False) -> dict:
    from jaxrl_scale.train import Trainer

    out = Path(out)
    policy = cfg.model.init_from
    if from_scratch:
        policy = str(make_demo_policy(cfg, out / "policy"))
    elif policy is None:
        if not (DEMO_POLICY / "config.json").exists():
            raise FileNotFoundError(
                f"{DEMO_POLICY} is missing: rebuild it with scripts/make_demo_policy.py, or run "
                "jaxrl-scale demo --from-scratch"
            )
        policy = str(DEMO_POLICY)
    # RL starts from that policy: the warm start (train.sft_steps) is what made it.
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, init_from=policy),
        train=dataclasses.replace(cfg.train, sft_steps=0),
    )
    print(f"policy: {policy}")
    start = time.perf_counter()
    rows = Trainer(cfg, out, resume=False).train()
    train_s = time.perf_counter() - start
    print(f"\nRL: {rows[-1]['step']} steps in {train_s:.0f} s; fitting the eval curve ...")
    summary = summarise(rows, out, x=cfg.forecast.x)
    summary["train_seconds"] = train_s
    (out / "fit.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    print(f"\nrun directory: {out}")
    for name in ("metrics.jsonl", "tensorboard", "fit.png", "fit.json"):
        print(f"  {out / name}")
    return summary
