"""Multi-turn episodes with slow environments: the slot engine against turn-by-turn waves.

    python benchmarks/bench_episode_engine.py [--batches 3] [--slots 16] [--turn 32]
        [--parked -1] [--admit-every 8]

Episodes of 4 model turns of `--turn` tokens (an untrained model: every turn runs to its
budget), each followed by an environment step that sleeps `delay` seconds and answers a
6-token observation. Four ways of generating the same batches (8 prompts x 4 episodes, the
next batch queued behind on the engine), each first with instant environments, then with
`delay` = one turn's decode on the engine (its measured seconds per decode step x `--turn`):
  - engine: the slot engine, an episode waiting for its environment moved to a parking row
    so that its slot decodes another (`sampler.parked_rows` = slots, the default);
  - engine, no parking: a waiting episode keeps its slot (`sampler.parked_rows: 0`);
  - static waves: every live episode's next turn in waves of `--slots` rows, each turn's
    whole context prefilled, then every environment stepped (nothing decodes meanwhile).
Prints per way: episodes/s, generated (model) tokens/s (on the engine counting the turns
sampled for batches not yet returned, see `in_flight`), the engine's slot occupancy (slot-
steps that decoded or fed a token, of all slot-steps) and the ratio of tokens/s with slow
environments to tokens/s with instant ones (the goal: above 0.8 on the engine).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import jax
from flax import nnx

from jaxrl_scale.config import load_config
from jaxrl_scale.generation.sampler import Sampling
from jaxrl_scale.models.policy import init_policy
from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.parallel.sharding import make_mesh
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.episodes import EngineEpisodes, EpisodeRunner
from jaxrl_scale.rl.generator import WaveGenerator
from jaxrl_scale.tasks.env import EnvRunner

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_arithmetic.yaml"
TURNS = 4


class Slow:
    """Four turns; each step sleeps `delay` s (an environment's own work) and answers."""

    def __init__(self, delay: float):
        self.delay, self.taken = delay, 0

    def reset(self) -> str:
        return "1+2="

    def step(self, action: str):
        time.sleep(self.delay)
        self.taken += 1
        if self.taken >= TURNS:
            return None, 1.0, True
        return " =====", 0.0, False


class SlowTask:
    name = "slow"

    def __init__(self):
        self.tokenizer = CharTokenizer("0123456789+-*= ")
        self.train_examples = [{"i": i} for i in range(256)]
        self.eval_examples = self.train_examples[:8]
        self.delay = 0.0
        self._lock = threading.Lock()  # read on the environments' threads, set between runs

    def make_env(self, example):
        with self._lock:
            return Slow(self.delay)


def setup(args, parked_rows: int):
    budget = 4 + TURNS * args.turn + (TURNS - 1) * 6
    cfg = load_config(CONFIG, [
        "model.hidden_size=256", "model.intermediate_size=512", "model.num_layers=4",
        "model.num_heads=4", "model.num_kv_heads=2", "mesh.data=1",
        "train.prompts_per_step=8", "train.group_size=4", f"sampler.slots={args.slots}",
        f"sampler.parked_rows={parked_rows}", f"sampler.admit_every={args.admit_every}",
        f"task.max_turns={TURNS}", f"task.max_episode_tokens={budget}",
        f"task.turn_tokens={args.turn}", f"task.env_workers={4 * args.slots}",
        "pipeline.mode=pipeline_rl",
    ])  # fmt: skip
    task = SlowTask()
    graphdef, params = nnx.split(init_policy(cfg.model, seed=0))
    mesh = make_mesh(cfg.mesh)
    waves = WaveGenerator(cfg, graphdef, task.tokenizer, None, mesh=mesh, own_devices=False,
                          longest_prompt=budget)  # fmt: skip
    runner = EpisodeRunner(cfg, task, task.tokenizer, waves.generate,
                           EnvRunner(workers=cfg.task.env_workers, timeout=60))  # fmt: skip
    engine = EngineEpisodes(
        cfg, graphdef, task.tokenizer, runner, mesh=mesh, slots=args.slots,
        sampling=Sampling(1.0), curriculum=Curriculum(len(task.train_examples), seed=0),
        examples=task.train_examples,
    )  # fmt: skip
    return cfg, task, params, runner, engine


def in_flight(engine) -> int:
    """Model tokens of the turns already handed back in batches not yet returned (the batch
    queued behind decodes while the head batch's last episodes wait for their environments:
    counting returned batches only would credit that work to whichever measurement returns
    them)."""
    return int(sum(sum(ep.mask) for batch in engine.queued for ep in batch.episodes))


def measure_engine(args, engine, params, batches: int) -> dict:
    key = jax.random.key(0)
    e = engine.engine
    steps0, slot_steps0 = (0, 0) if e is None else (e.steps, e.slot_steps)
    waited0 = engine.waited
    start = time.perf_counter()
    episodes, sampled = 0, -in_flight(engine)
    for b in range(batches):
        _, ro, _, _ = engine.next(lambda chunk: (0, params), jax.random.fold_in(key, b), None)
        sampled += int(ro.completion_mask.sum())
        episodes += ro.lengths.shape[0]
    seconds = time.perf_counter() - start
    sampled += in_flight(engine)
    steps = engine.engine.steps - steps0
    return {
        "episodes_per_s": episodes / seconds,
        "tokens_per_s": sampled / seconds,
        "occupancy": (engine.engine.slot_steps - slot_steps0) / max(steps * args.slots, 1),
        "seconds_per_step": seconds / max(steps, 1),
        "waited": (engine.waited - waited0) / seconds,  # nothing to decode: all at their envs
        "decoding_s_per_step": (seconds - engine.waited + waited0) / max(steps, 1),
    }


def measure_static(cfg, task, params, runner, batches: int) -> dict:
    key = jax.random.key(0)
    start = time.perf_counter()
    episodes = sampled = 0
    g = cfg.train.group_size
    for b in range(batches):
        examples = task.train_examples[8 * b : 8 * b + 8]
        ro, _, _ = runner.run(lambda chunk: (0, params), examples, jax.random.fold_in(key, b),
                              sampling=Sampling(1.0), repeat=g)  # fmt: skip
        sampled += int(ro.completion_mask.sum())
        episodes += ro.lengths.shape[0]
    seconds = time.perf_counter() - start
    return {"episodes_per_s": episodes / seconds, "tokens_per_s": sampled / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--turn", type=int, default=32)
    parser.add_argument("--parked", type=int, default=-1, help="sampler.parked_rows")
    parser.add_argument("--admit-every", type=int, default=8, help="sampler.admit_every")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.slots} slots, "
          f"{args.parked} parked rows, {TURNS} turns of {args.turn} tokens, 32 episodes a "
          f"batch, {args.batches} batches, engine runs of {args.admit_every} steps")  # fmt: skip
    results, delay = {}, None
    for name, parked in (("engine", args.parked), ("engine, no parking", 0)):
        cfg, task, params, runner, engine = setup(args, parked)
        measure_engine(args, engine, params, 1)  # compiles
        fast = measure_engine(args, engine, params, args.batches)
        if delay is None:  # one turn's decode on the engine
            delay = fast["seconds_per_step"] * args.turn
            print(f"a turn's decode on the engine: {delay * 1e3:.0f} ms (the slow env's step)")
        task.delay = delay
        slow = measure_engine(args, engine, params, args.batches)
        task.delay = 0.0
        results[name] = (fast, slow)
        print(
            f"{name}: share of time with nothing to decode fast/slow env "
            f"{fast['waited']:.2f}/{slow['waited']:.2f}; seconds per step otherwise "
            f"{fast['decoding_s_per_step'] * 1e3:.2f}/{slow['decoding_s_per_step'] * 1e3:.2f} ms"
        )
    cfg, task, params, runner, _ = setup(args, 0)
    measure_static(cfg, task, params, runner, 1)  # compiles
    fast = measure_static(cfg, task, params, runner, args.batches)
    task.delay = delay
    results["static waves"] = (fast, measure_static(cfg, task, params, runner, args.batches))
    print(f"{'':20s} {'episodes/s':>21s} {'tokens/s':>21s} {'occupancy':>17s} {'slow/fast':>9s}")
    print(f"{'':20s} {'fast env':>10s} {'slow env':>10s} {'fast env':>10s} {'slow env':>10s} "
          f"{'fast':>8s} {'slow':>8s} {'tokens/s':>9s}")  # fmt: skip
    for name, (fast, slow) in results.items():
        occ = [f"{r['occupancy']:8.2f}" if "occupancy" in r else f"{'-':>8s}" for r in (fast, slow)]
        print(f"{name:20s} {fast['episodes_per_s']:10.2f} {slow['episodes_per_s']:10.2f} "
              f"{fast['tokens_per_s']:10.0f} {slow['tokens_per_s']:10.0f} {occ[0]} {occ[1]} "
              f"{slow['tokens_per_s'] / fast['tokens_per_s']:9.2f}")  # fmt: skip
    engine_slow = results["engine"][1]["tokens_per_s"]
    print(
        f"engine with slow envs / static waves with slow envs, tokens/s: "
        f"{engine_slow / results['static waves'][1]['tokens_per_s']:.2f}"
    )


if __name__ == "__main__":
    main()
