"""The recipe study: several configs x seeds, each run fitted, the configs compared by their curves.

    jaxrl-scale sweep configs/study/*.yaml --seeds 0 1 --out runs/study

For every config and seed, `<out>/<config>/seed<S>/` is a normal run directory; a run counts as
finished once its `result.json` is written, so a killed sweep started again skips finished runs
and resumes the one it was in from its last checkpoint (`--refit` fits finished runs again
from their metrics, training nothing). Per run: the final fit (A [interval],
B, C_mid, R0 held at the step-0 eval) and the predictive check (the fit at 50% of the run's
compute forecasts its final eval; error and whether the 95% interval covered it). Per config:
the recipe's ceiling (fit.recipe: the mean of its seeds' A, with an interval that includes the
spread between seeds), the seeds' eval curves averaged step by step and fitted, the configs
ranked by the recipe's A, each pair's ceilings compared (an interval for the difference), and
any two that are indistinguishable or within `margin` refitted with a shared A and compared by
B (the paper's rule).
Writes `<out>/study.json`, `<out>/study.md` (the tables) and `<out>/study.png` (all configs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_scale.config import load_config
from jaxrl_scale.fit import Curve, bootstrap_sigmoid, shared_ceiling
from jaxrl_scale.fit.recipe import compare_ceilings, recipe_ceiling
from jaxrl_scale.fit.report import (
    describe_shared,
    fit_run,
    identified_label,
    run_curve,
    shared_entry,
)
from jaxrl_scale.rl.metrics import read_metrics

N_BOOT = 1000


def mean_curve(runs: list[list[dict[str, Any]]], name: str, x: str = "compute_flops") -> Curve:
    """Several seeds' runs as one curve: eval points averaged at each eval step they share,
    R0 the mean of their R0s."""
    curves = [run_curve(rows, x, name) for rows in runs]
    shared = sorted(set.intersection(*(set(c.steps.tolist()) for c in curves)))
    picks = [np.isin(c.steps, shared) for c in curves]  # steps are increasing
    compute = np.mean([c.compute[k] for c, k in zip(curves, picks, strict=True)], axis=0)
    rate = np.mean([c.reward[k] for c, k in zip(curves, picks, strict=True)], axis=0)
    r0 = float(np.mean([c.r0 for c in curves]))
    return Curve(name, compute, rate, r0=r0, steps=np.asarray(shared))


def run_sweep(
    configs: list[str | Path],
    out: str | Path,
    *,
    seeds: list[int],
    overrides: list[str] = (),
    margin: float = 0.02,
    n_boot: int = N_BOOT,
    refit: bool = False,
) -> dict[str, Any]:
    """`refit`: finished runs are fitted again from their metrics (after the fit's defaults
    changed, say) instead of read back from their result.json; nothing is retrained."""
    from jaxrl_scale.train import train

    out = Path(out)
    names = [Path(c).stem for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"config file names must be unique (they name the runs): {names}")
    runs: list[dict[str, Any]] = []
    x = load_config(configs[0], overrides).forecast.x  # the compute axis every fit uses

    def fit(run_dir: Path) -> dict[str, Any]:
        return fit_run(read_metrics(run_dir), x=x, n_boot=n_boot).summary()

    for path, name in zip(configs, names, strict=True):
        for seed in seeds:
            run_dir = out / name / f"seed{seed}"
            done = run_dir / "result.json"
            if done.exists():
                result = json.loads(done.read_text())
                if refit:
                    result.update(fit(run_dir))
                    done.write_text(json.dumps(result, indent=2))
                print(f"{name} seed {seed}: finished earlier, {'refitted' if refit else 'skipped'}",
                      flush=True)  # fmt: skip
                runs.append(result)
                continue
            cfg = load_config(path, [*overrides, f"seed={seed}"])
            print(f"{name} seed {seed}: training -> {run_dir}", flush=True)
            start = time.perf_counter()
            train(cfg, run_dir)  # resumes from the run's last checkpoint, if any
            result = {
                "config": name,
                "seed": seed,
                "path": str(path),
                "run_dir": str(run_dir),
                "wall_seconds": time.perf_counter() - start,
                **fit(run_dir),
            }
            done.write_text(json.dumps(result, indent=2))
            runs.append(result)
    study = compare(out, names, runs, margin=margin, n_boot=n_boot, x=x)
    (out / "study.json").write_text(json.dumps(study, indent=2))
    (out / "study.md").write_text(format_study(study) + "\n")
    return study


def compare(out: Path, names, runs, *, margin: float, n_boot: int, x: str) -> dict[str, Any]:
    """Per-config recipe ceilings and fits of the seed-averaged curves, the ranking by the
    recipe's A, pairwise ceiling verdicts, shared-A comparisons, and the plot."""
    from jaxrl_scale.fit.plot import plot_fits

    configs, curves, entries, recipes = [], {}, [], {}
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        recipe = recipe_ceiling(name, [r["a"] for r in mine], [r["a_ci"] for r in mine])
        recipes[name] = recipe
        curve = mean_curve([read_metrics(r["run_dir"]) for r in mine], name, x)
        boot = bootstrap_sigmoid(curve.compute, curve.reward, n=n_boot, r0=curve.r0)
        curves[name] = curve
        entries.append((curve, boot, None))
        declining = [r["seed"] for r in mine if r.get("declining")]
        configs.append(
            {
                "config": name,
                "seeds": len(mine),
                "declining_seeds": declining,
                "final_pass_rate": float(curve.reward[-1]),
                "recipe_a": recipe.a,
                "recipe_a_ci": list(recipe.ci),
                "between_seed_sd": recipe.between_sd,
                **boot.to_dict(),  # the fit of the seed-averaged curve
            }
        )
    # A config with a declining seed is named, not ranked: its runs' ceilings describe a rise
    # the runs did not keep.
    falling = [c["config"] for c in configs if c["declining_seeds"]]
    ranking = sorted((n for n in names if n not in falling), key=lambda n: -recipes[n].a)
    ceilings, shared = [], []
    for i, first in enumerate(ranking):
        for second in ranking[i + 1 :]:
            d = compare_ceilings(recipes[first], recipes[second])
            ceilings.append(
                {"configs": [first, second], "diff": d.diff, "diff_ci": list(d.ci),
                 "verdict": d.verdict}
            )  # fmt: skip
            close = abs(d.diff) < margin
            if close or d.verdict == "indistinguishable":
                s = shared_ceiling(curves[first], curves[second], n_boot=n_boot)
                shared.append(shared_entry(s))
    halves = [r["half_run"] for r in runs if r["half_run"] is not None]
    errors = np.array([h["error"] for h in halves])
    validity = {
        "runs": len(runs),
        "forecasts": len(halves),
        "abs_error_median": float(np.median(np.abs(errors))) if halves else None,
        "abs_error_max": float(np.max(np.abs(errors))) if halves else None,
        "covered": int(sum(h["covered"] for h in halves)),
    }
    plot = plot_fits(entries, out / "study.png", xlabel=x, ylabel="held-out pass rate")
    return {
        "x": x,
        "margin": margin,
        "runs": runs,
        "configs": configs,
        "ranking": ranking,
        "declining": falling,
        "ceilings": ceilings,
        "shared_ceiling": shared,
        "predictive_validity": validity,
        "plot": str(plot),
    }


def format_study(study: dict[str, Any]) -> str:
    lines = [
        "Recipe A: the mean of the seeds' own ceilings, its interval including the spread "
        "between seeds. Mean-curve fit: the seeds' eval curves averaged, then fitted (its "
        "interval is for that averaged run only).",
        "",
        "| config | seeds | R0 | final | recipe A [95% interval] | between-seed sd | "
        "mean-curve A [95%] | B | C_mid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in study["configs"]:
        lo, hi = c["a_ci"]
        r_lo, r_hi = c["recipe_a_ci"]
        flag = f" (identified: {identified_label(c['identified'])})" if "identified" in c else ""
        if c.get("declining_seeds"):
            flag += f" declining seeds {c['declining_seeds']}"
        lines.append(
            f"| {c['config']} | {c['seeds']} | {c['r0']:.3f} | {c['final_pass_rate']:.3f} | "
            f"{c['recipe_a']:.3f} [{r_lo:.3f}, {r_hi:.3f}] | {c['between_seed_sd']:.3f} | "
            f"{c['a']:.3f} [{lo:.3f}, {hi:.3f}]{flag} | {c['b']:.2f} | {c['c_mid']:.3g} |"
        )
    lines.append("")
    lines.append("ranking by the recipe's A: " + (" > ".join(study["ranking"]) or "(none)"))
    if study.get("declining"):
        lines.append(
            "declining, not ranked (a seed's evals fell after a peak beyond their noise): "
            + ", ".join(study["declining"])
        )
    for d in study["ceilings"]:
        first, second = d["configs"]
        lo, hi = d["diff_ci"]
        verdict = d["verdict"]
        if verdict in (first, second):
            verdict = f"{verdict} has the higher ceiling"
        lines.append(
            f"{first} - {second}: recipe A difference {d['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            f" -> {verdict}"
        )
    for s in study["shared_ceiling"]:
        lines.append(describe_shared(s, study["margin"]))
    lines += [
        "",
        "| run | A [95% interval] | identified | half-run forecast of the final eval | actual | "
        "error | covered |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in study["runs"]:
        h = r["half_run"]
        lo, hi = r["a_ci"]
        if h is not None:
            forecast = (
                f"{h['predicted_final']:.3f} [{h['interval'][0]:.3f}, {h['interval'][1]:.3f}]"
            )
            tail = (
                f"{h['actual_final']:.3f} | {h['error']:+.3f} | {'yes' if h['covered'] else 'no'}"
            )
        else:
            forecast, tail = "n/a", "| | "
        identified = identified_label(r["identified"]) if "identified" in r else "n/a"
        if r.get("declining"):
            d = r["declining"]
            identified += f"; declining: peak at x = {d['peak_x']:.3g}, drop {d['drop']:.3f}"
        lines.append(
            f"| {r['config']} seed {r['seed']} | {r['a']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{identified} | {forecast} | {tail} |"
        )
    v = study["predictive_validity"]
    if v["forecasts"]:
        lines.append(
            f"\nhalf-run forecasts: median |error| {v['abs_error_median']:.3f}, max "
            f"{v['abs_error_max']:.3f}; the 95% interval covered {v['covered']} of "
            f"{v['forecasts']}"
        )
    return "\n".join(lines)
