"""Which task a run trains on and its built-in tasks' settings (`task.*`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxrl_scale.configbase import require
from jaxrl_scale.tasks.sandbox import SandboxLimits


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """task.arithmetic: procedural integer problems (tasks/arithmetic.py)."""

    max_digits: int = 2  # operands have 1..max_digits digits
    ops: str = "+-"  # operators drawn from
    # Probability that a warm-start demonstration is wrong (its last digit off by one), so the
    # warm-started policy knows the answer but is unsure of it: what RL fixes.
    demo_noise: float = 0.0

    def __post_init__(self):
        key = "task.arithmetic"
        require(self.max_digits >= 1, f"{key}.max_digits", f"must be >= 1, got {self.max_digits}")
        require(
            bool(self.ops) and set(self.ops) <= set("+-*"), f"{key}.ops", "use characters of '+-*'"
        )
        require(0 <= self.demo_noise <= 1, f"{key}.demo_noise", "must be in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """task.countdown: reach a target with + - * / over given numbers (tasks/countdown.py)."""

    numbers: int = 3  # given numbers per problem
    max_number: int = 20  # each in 1..max_number
    max_target: int = 100  # targets in 1..max_target

    def __post_init__(self):
        key = "task.countdown"
        require(2 <= self.numbers <= 6, f"{key}.numbers", f"must be in [2, 6], got {self.numbers}")
        require(self.max_number >= 2, f"{key}.max_number", "must be >= 2")
        require(self.max_target >= 1, f"{key}.max_target", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathConfig:
    """task.math: word problems with reference answers, checked by math-verify (tasks/math.py)."""

    data: str | None = (
        None  # .jsonl / .parquet file, or a Hugging Face dataset name[:config[:split]]
    )
    eval_data: str | None = None  # held-out file or dataset; None: num_eval rows of `data`
    question_key: str = "problem"
    answer_key: str = "answer"
    template: str = (
        "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    )
    verify_timeout: float = 5.0  # seconds per math-verify call before the answer scores 0

    def __post_init__(self):
        require("{question}" in self.template, "task.math.template", "must contain '{question}'")
        require(self.verify_timeout > 0, "task.math.verify_timeout", "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeConfig:
    """task.code: programs graded by stdin/stdout unit tests in a sandbox (tasks/code.py,
    tasks/sandbox.py; docs/code_sandbox.md)."""

    data: str | None = None  # .jsonl rows {"prompt", "tests": [{"input", "output"}, ...]}
    eval_data: str | None = None  # held-out file; None: num_eval rows of `data`
    template: str | None = None  # None: the task's ("{prompt}" + ask for one python block)
    partial_credit: bool = False  # score = the fraction of tests passed (else all or nothing)
    # The strongest isolation that works here ("auto"), or one of tasks.sandbox.LEVELS; with
    # rlimits alone the task refuses to run unless allow_unisolated is set.
    isolation: Literal["auto", "namespaces+uid+rlimits", "uid+rlimits", "rlimits"] = "auto"
    allow_unisolated: bool = False
    workers: int = 0  # programs run at once; 0: what cores and memory hold (default_workers)
    limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)

    def __post_init__(self):
        require(self.workers >= 0, "task.code.workers", "must be >= 0")
        if self.template is not None:
            require("{prompt}" in self.template, "task.code.template", "must contain '{prompt}'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymConfig:
    """task.reasoning_gym: reasoning-gym's procedural datasets (tasks/reasoning_gym.py; the
    optional dependency: pip install 'jaxrl-scale[reasoning-gym]')."""

    datasets: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> weight
    configs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # per dataset
    template: str | None = None  # None: the question, then ask for <answer></answer> tags

    def __post_init__(self):
        bad = {n: w for n, w in self.datasets.items() if not w > 0}
        require(not bad, "task.reasoning_gym.datasets", f"weights must be > 0: {bad}")
        if self.template is not None:
            require(
                "{question}" in self.template,
                "task.reasoning_gym.template",
                "must contain '{question}'",
            )


BUILTIN = ("arithmetic", "countdown", "math", "code", "reasoning_gym", "mixture")  # make_task's


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureComponent:
    """One domain of task.mixture: a task (built-in, set by its task.<name> section, or an
    import path with `args`), its share of the training prompts, the domain it is logged as."""

    name: str
    weight: float = 1.0
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    domain: str | None = None  # default: the name (an import path's factory name)

    @property
    def label(self) -> str:
        return self.domain or self.name.rpartition(":")[2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The verifiable task (see jaxrl_scale/tasks): what every task has, then one section per
    built-in task; only the section `name` picks is read."""

    # A built-in task, or your own as an import path 'package.module:factory' called with
    # `args` (tasks/user.py).
    name: str = "arithmetic"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_train: int = 512  # prompts in the training pool (math, code, your own: 0 = every row)
    num_eval: int = 64  # held-out prompts (your own task's: at most this many)
    # Scoring (tasks/scoring.py): worker processes that run the verifier, seconds a sample
    # may take before its worker is killed and it scores 0 (counted in reward_timeouts), the
    # thinking cut off before scoring, weights of a scorer's named parts (default 1 each).
    score_workers: int = 8
    score_timeout: float = 30.0
    # A batch whose samples failed to score (errors and timeouts) above this fraction ends
    # the run (ScorerBroken): scoring is broken, not the samples. 1.0: never.
    max_failure_fraction: float = 0.5
    strip_think: bool = True
    reward_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    # The named part whose value is a sample's pass (0 or 1) for pass rates, the curriculum
    # and eval_pass_rate (default: the task's `pass_part`, else the reward itself).
    pass_part: str | None = None
    # Multi-turn tasks (a `make_env`, tasks/env.py; rl/episodes.py): model turns per episode,
    # the episode's whole context in tokens (prompt, turns, observations), each turn's budget
    # (0: sampler.max_new_tokens), worker processes that run the environments, seconds per
    # env call (past it the call's worker is killed, with the episodes it held).
    max_turns: int = 1
    max_episode_tokens: int = 1024
    turn_tokens: int = 0
    # On the slot engine: the prompt columns of an episode's row (a longer first observation's
    # rest is fed as given tokens into its completion columns); 0: the first batch's longest
    # first observation, rounded up to 8.
    prompt_tokens: int = 0
    env_workers: int = 16
    env_timeout: float = 60.0
    tool_timeout: float = 10.0  # seconds a tool call may take (tasks/tools.py)
    # Agent tasks (rl/agents.py): `agent(base_url, api_key, example) -> reward` as an import
    # path 'package.module:function' ("": the task object's own `agent`), threads running
    # agents at once, seconds an agent's episode may take.
    agent: str = ""
    agent_workers: int = 32
    agent_timeout: float = 600.0
    # name: mixture: the domains and their weights (tasks/mixture.py), e.g.
    # [{name: math, weight: 1}, {name: code, weight: 1}]
    mixture: tuple[MixtureComponent, ...] = ()
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)
    countdown: CountdownConfig = dataclasses.field(default_factory=CountdownConfig)
    math: MathConfig = dataclasses.field(default_factory=MathConfig)
    code: CodeConfig = dataclasses.field(default_factory=CodeConfig)
    reasoning_gym: ReasoningGymConfig = dataclasses.field(default_factory=ReasoningGymConfig)

    @property
    def imported(self) -> bool:
        """Whether `name` is an import path (the user's task) rather than a built-in."""
        return ":" in self.name

    def __post_init__(self):
        require(
            self.name in BUILTIN or self.imported,
            "task.name",
            f"{self.name!r} is neither a built-in task ({', '.join(BUILTIN)}) nor an import "
            "path 'package.module:factory'",
        )
        require(
            not self.args or self.imported,
            "task.args",
            f"only a task given by import path takes args; the built-in {self.name!r} is set "
            f"by task.{self.name}.*",
        )
        self._check_mixture()
        require(self.num_train >= 0, "task.num_train", "must be >= 0")
        require(
            self.num_train >= 1 or self.name in ("math", "code", "mixture") or self.imported,
            "task.num_train",
            "must be >= 1",
        )
        require(self.num_eval >= 1, "task.num_eval", "must be >= 1")
        require(self.score_workers >= 1, "task.score_workers", "must be >= 1")
        require(self.max_turns >= 1, "task.max_turns", "must be >= 1")
        require(self.max_episode_tokens >= 2, "task.max_episode_tokens", "must be >= 2")
        require(self.turn_tokens >= 0, "task.turn_tokens", "must be >= 0")
        require(
            0 <= self.prompt_tokens < self.max_episode_tokens,
            "task.prompt_tokens",
            f"must be in [0, task.max_episode_tokens = {self.max_episode_tokens})",
        )
        require(self.env_workers >= 1, "task.env_workers", "must be >= 1")
        require(self.env_timeout > 0, "task.env_timeout", "must be > 0")
        require(self.tool_timeout > 0, "task.tool_timeout", "must be > 0")
        require(
            not self.agent or ":" in self.agent,
            "task.agent",
            f"{self.agent!r} is not an import path 'package.module:function'",
        )
        require(self.agent_workers >= 1, "task.agent_workers", "must be >= 1")
        require(self.agent_timeout > 0, "task.agent_timeout", "must be > 0")
        require(self.score_timeout > 0, "task.score_timeout", "must be > 0")
        require(
            0 <= self.max_failure_fraction <= 1,
            "task.max_failure_fraction",
            f"must be in [0, 1], got {self.max_failure_fraction}",
        )

    def _check_mixture(self) -> None:
        if self.name != "mixture":
            require(not self.mixture, "task.mixture", "is read only with task.name: mixture")
            return
        require(bool(self.mixture), "task.mixture", "a mixture needs its components")
        for i, c in enumerate(self.mixture):
            key = f"task.mixture[{i}]"
            require(
                c.name != "mixture" and (c.name in BUILTIN or ":" in c.name),
                f"{key}.name",
                f"{c.name!r} is neither a built-in task nor 'package.module:factory'",
            )
            require(c.weight > 0, f"{key}.weight", f"must be > 0, got {c.weight}")
            require(not c.args or ":" in c.name, f"{key}.args", "only for an import path")
            require("/" not in c.label, f"{key}.domain", "a domain's name has no '/'")
        labels = [c.label for c in self.mixture]
        dupes = sorted({d for d in labels if labels.count(d) > 1})
        require(not dupes, "task.mixture", f"domains {dupes} repeat: give each a `domain`")
