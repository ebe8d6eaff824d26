"""The rollout worker on a tiny model: where lockstep swaps weights on each path, how static
generation splits prompts into waves over the generator's devices, and its prompt widths."""

import itertools

import jax
import numpy as np
import pytest
from conftest import FAST, TINY_CONFIG

from jaxrl_scale.config import ConfigError, load_config
from jaxrl_scale.generation.sampler import Sampling, prompt_width
from jaxrl_scale.rl.generator import wave_prompts, wave_rows
from jaxrl_scale.rl.pipeline import ParamsSource, make_feeder
from jaxrl_scale.train import setup

# A vocabulary far wider than the task's 17 tokens: an untrained model then rarely samples EOS
# and its rows run to the length limit, so a batch's decode steps are known in advance.
LOCKSTEP = ["pipeline.mode=pipeline_rl", "pipeline.lockstep=true", "pipeline.max_staleness=1",
            "model.vocab_size=512"]  # fmt: skip


def _run(tmp_path, *extra):
    cfg = load_config(TINY_CONFIG, [*FAST, *extra])
    run = setup(cfg, tmp_path)
    return cfg, run.worker, run.start.train.params


def _second_batch(cfg, worker, params, produce):
    """Lockstep as train.py drives it: batch 0 with version 0, then batch 1 generated inside
    `trained(…, 1)`, with version 1 swapped in part-way."""
    source = ParamsSource(0, params, place=worker.to_generator)
    feeder = make_feeder(
        cfg.pipeline, produce, source, jax.random.key(0), version=0, chunks=worker.chunks
    )
    feeder.next()
    feeder.trained(params, 1)
    return feeder.pending[0]


def test_lockstep_on_the_slot_engine_swaps_weights_halfway_through_a_batch(tmp_path):
    """On the slot engine a chunk is an engine run of admit_every (8) steps; the new weights
    must arrive after about half of the batch's 64 decode steps, not after its first run."""
    n_new = 64
    cfg, worker, params = _run(
        tmp_path, *LOCKSTEP, "sampler.batching=continuous", f"sampler.max_new_tokens={n_new}"
    )
    calls = []  # (engine decode step when a run's parameters were asked for, their version)

    def produce(params_for_chunk, key, *, oldest):
        def recorded(chunk):
            version, p = params_for_chunk(chunk)
            calls.append((int(worker.engine.state.step), version))
            return version, p

        calls.clear()
        return worker.rollouts(recorded, key, oldest=oldest)

    batch = _second_batch(cfg, worker, params, produce)
    swaps = [step - calls[0][0] for step, version in calls if version == 1]
    assert swaps and abs(swaps[0] - n_new // 2) <= cfg.sampler.admit_every, calls
    assert {0, 1} <= set(np.unique(batch.versions).tolist())  # both versions sampled it


def test_lockstep_on_static_waves_swaps_weights_at_the_batch_middle(tmp_path):
    """A batch in two waves (8 rows each) of four 4-step chunks: the swap lands halfway
    through the batch's decode steps, at the second wave, not halfway through the first."""
    cfg, worker, params = _run(
        tmp_path, *LOCKSTEP, "sampler.batching=static", "sampler.max_new_tokens=16",
        "sampler.chunk_size=4", "sampler.slots=8",
    )  # fmt: skip
    batch = _second_batch(cfg, worker, params, worker.rollouts)
    v = batch.versions
    assert set(np.unique(v[:8]).tolist()) <= {-1, 0} and (v[:8] == 0).any()
    assert set(np.unique(v[8:]).tolist()) <= {-1, 1} and (v[8:] == 1).any()


def test_wave_prompts_fill_the_bound_with_rows_that_split_evenly():
    configs = {
        slots: load_config(TINY_CONFIG, [*FAST, f"sampler.slots={slots}", "train.group_size=1"])
        for slots in [0, 24, 30, 64]
    }
    for slots, repeat, ways, n in itertools.product(
        configs, [1, 2, 3, 4, 12, 16], [1, 2, 4, 8], [1, 5, 7, 20, 500]
    ):
        cfg = configs[slots]
        bound = slots or 4  # train.prompts_per_step x train.group_size
        multiple = ways // np.gcd(ways, repeat)
        if multiple * repeat > bound:
            with pytest.raises(ConfigError, match="sampler.slots / train.eval_samples"):
                wave_prompts(cfg, repeat, ways, n)
            continue
        p = wave_prompts(cfg, repeat, ways, n)
        rows = wave_rows(cfg, repeat, ways, n)
        assert rows == p * repeat and rows % ways == 0 and rows <= bound
        assert p < n + multiple  # never more filler than one multiple
        assert p + multiple > min(n, bound // repeat)  # no room left for one more multiple
    # The 0.5B recipe's evaluation (sampler.slots 0): 500 prompts x 16 samples on 8 devices
    # decode in waves of one train batch's rows (8 x 16), not 8,000 rows at once.
    cfg = load_config(TINY_CONFIG, [*FAST, "train.prompts_per_step=8", "train.group_size=16"])
    assert wave_rows(cfg, 16, 8, 500) == 128


def test_waves_split_evenly_over_the_generator_devices(tmp_path):
    """20 prompts x 3 samples on 8 devices, at most 40 rows a wave: waves of 8 prompts
    (24 rows; 13 prompts would be 39 rows, which 8 devices do not split), the last one
    filled up and its filler rows dropped; greedy tokens equal those on one device."""
    extra = ["sampler.slots=40", "train.prompts_per_step=8", "task.num_eval=20",
             "train.eval_samples=3", "train.eval_temperature=0"]  # fmt: skip
    _, eight, params = _run(tmp_path / "eight", *extra, "mesh.data=-1")
    _, one, params_one = _run(tmp_path / "one", *extra, "mesh.data=1")  # the same init
    prompts = eight._encode(eight.task.eval_examples)
    # Chunks are numbered on across waves: a row's last version tells its wave apart.
    args = dict(sampling=Sampling(0.0), n_new=4, repeat=3)
    ro = eight.generate(lambda chunk: (chunk, params), prompts, jax.random.key(0), **args)
    _, rows = np.unique(np.asarray(ro.versions).max(axis=1), return_counts=True)
    assert rows.tolist() == [24, 24, 12]  # 4 filler prompts' rows dropped
    single = one.generate(lambda chunk: (chunk, params_one), prompts, jax.random.key(0), **args)
    np.testing.assert_array_equal(ro.completion_tokens, single.completion_tokens)
    np.testing.assert_array_equal(ro.prompt_tokens, single.prompt_tokens)
    longest = max(len(p) for p in prompts)
    assert ro.prompt_tokens.shape[1] == prompt_width(longest, eight.waves.longest_prompt)
    # mean@3 over the 20 held-out prompts, in those waves: as on one device.
    rate = eight.evaluate(params, jax.random.key(1))
    assert rate == one.evaluate(params_one, jax.random.key(1))


def test_a_wave_that_cannot_split_over_the_generator_is_refused_at_setup(tmp_path):
    with pytest.raises(ConfigError, match="train.eval_samples"):  # 8 prompts x 3 = 24 > 16
        _run(tmp_path, "mesh.data=-1", "sampler.slots=16", "train.eval_samples=3")


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_stopping_the_generator_thread_abandons_a_real_batch_between_chunks(tmp_path, batching):
    """The worker's own generation (slot engine runs, or static chunks) stops at the next
    chunk when the feeder stops: the halt is not swallowed, the thread ends, and the batch it
    was generating is counted."""
    import threading
    import time

    cfg, worker, params = _run(
        tmp_path, "pipeline.mode=pipeline_rl", "model.vocab_size=512",
        "sampler.max_new_tokens=4000", "sampler.chunk_size=2", "sampler.admit_every=2",
        f"sampler.batching={batching}",
    )  # fmt: skip
    asked = threading.Event()
    source = ParamsSource(0, params, place=worker.to_generator)

    def produce(params_for_chunk, key, *, oldest):
        def counted(chunk):
            if chunk >= 3:  # well into the batch (its first chunks compiled)
                asked.set()
            return params_for_chunk(chunk)

        return worker.rollouts(counted, key, oldest=oldest)

    feeder = make_feeder(
        cfg.pipeline, produce, source, jax.random.key(0), version=0, chunks=worker.chunks
    )
    assert asked.wait(timeout=120)
    began = time.perf_counter()
    feeder.stop()
    assert time.perf_counter() - began < 30  # a chunk, not 4,000 decode steps
    assert not feeder.thread.is_alive()
    assert feeder.abandoned == 1 and feeder.untrained() == 1


def test_rows_that_fill_the_last_wave_are_charged_not_trained(tmp_path):
    """Four prompts in waves of three (sampler.slots = 12 rows of groups of 4): the second wave
    is filled up with two copies of its prompt. The batch holds the 16 rows asked for; the 8
    filling rows are counted and their decode is added to the generation compute."""
    from jaxrl_scale.rl.compute import batch_flops

    def batch(*extra):
        cfg, worker, params = _run(tmp_path / "_".join(extra), "sampler.batching=static", *extra)
        ro = worker.rollouts(lambda chunk: (0, params), jax.random.key(0))
        lengths = np.asarray(ro.batch.mask).sum(axis=1)  # every completion token sampled
        prompts = np.asarray(ro.batch.prompt_mask)[:: cfg.train.group_size].sum(axis=1)
        return ro, batch_flops(cfg.model, prompts, lengths)["gen_flops"]

    whole, rows_only = batch("sampler.slots=16")
    assert whole.stats["gen_fill_rows"] == 0 and whole.stats["gen_flops"] == rows_only
    filled, rows_only = batch("sampler.slots=12")
    assert filled.batch.mask.shape[0] == 16 and filled.stats["gen_fill_rows"] == 8
    assert filled.stats["gen_flops"] > rows_only  # 8 more rows, each a prompt and a token
