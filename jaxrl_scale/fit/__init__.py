"""Scaling-curve fitting: the ScaleRL sigmoid, batched, bootstrapped and differentiable.

from jaxrl_scale.fit import fit_sigmoid, bootstrap_sigmoid, sigmoid
fit = fit_sigmoid(compute, reward)              # [P] or [N, P]
boot = bootstrap_sigmoid(compute, reward, n=10_000)
boot.ci["a"], boot.predict_ci(1e5)
"""

from jaxrl_scale.fit.bootstrap import BootstrapResult, bootstrap_sigmoid
from jaxrl_scale.fit.comparison import Comparison, SharedCeiling, compare_runs, shared_ceiling
from jaxrl_scale.fit.curves import power_law, sigmoid
from jaxrl_scale.fit.data import Curve, CurveDataError, CurveDataWarning, clean_curve, load_curve
from jaxrl_scale.fit.extrapolation import ExtrapolationReport, extrapolation_check
from jaxrl_scale.fit.power_law_fit import PowerLawFit, fit_power_law
from jaxrl_scale.fit.recipe import (
    CeilingDifference,
    RecipeCeiling,
    compare_ceilings,
    recipe_ceiling,
)
from jaxrl_scale.fit.sigmoid_fit import FitResult, fit_sigmoid, influence

__all__ = [
    "BootstrapResult",
    "CeilingDifference",
    "Comparison",
    "Curve",
    "CurveDataError",
    "CurveDataWarning",
    "ExtrapolationReport",
    "FitResult",
    "PowerLawFit",
    "RecipeCeiling",
    "SharedCeiling",
    "bootstrap_sigmoid",
    "clean_curve",
    "compare_ceilings",
    "compare_runs",
    "extrapolation_check",
    "fit_power_law",
    "fit_sigmoid",
    "influence",
    "load_curve",
    "power_law",
    "recipe_ceiling",
    "shared_ceiling",
    "sigmoid",
]
