"""The engine side of the server (serve/engine.py): requests in token ids on the slot engine's
own thread, deltas back on an event loop."""

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
from conftest import HF_FIXTURES

from jaxrl_scale.generation.sampler import generate
from jaxrl_scale.models.hf import load_pretrained
from jaxrl_scale.serve.backend import QueueFull, Request
from jaxrl_scale.serve.engine import EngineBackend

PROMPT = (5, 6, 7, 8)


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_pretrained(HF_FIXTURES / "qwen2")
    backend = EngineBackend(model, tok, slots=4, context=32, prompt_len=8, max_queue=3, steps=2)
    yield model, tok, backend
    backend.close()


def _collect(backend, requests, *, cancel_after=None):
    """Every request's deltas, per choice: (tokens, logprobs, top, finish, deltas seen)."""

    async def one(request):
        generation = backend.submit(request, asyncio.get_running_loop())
        out = {i: [[], [], [], None, 0] for i in range(request.n)}
        async for d in generation.deltas():
            c = out[d.index]
            c[0] += d.token_ids
            c[1] += d.logprobs
            c[2] += d.top or []
            c[3] = d.finish
            c[4] += 1
            if cancel_after is not None and len(c[0]) >= cancel_after:
                generation.cancel()
        return out

    async def every():
        return await asyncio.wait_for(asyncio.gather(*map(one, requests)), timeout=120)

    return asyncio.run(every())


def test_greedy_requests_equal_the_sampler_and_stream_in_pieces(tiny):
    model, tok, backend = tiny
    want = generate(model, [list(PROMPT)], max_new_tokens=10, temperature=0.0,
                    eos_ids=tok.eos_ids)  # fmt: skip
    n = int(want.lengths[0])
    [got] = _collect(backend, [Request(PROMPT, max_new=10, temperature=0.0, top_logprobs=2)])
    tokens, logprobs, top, finish, deltas = got[0]
    assert tokens == np.asarray(want.completion_tokens[0, :n]).tolist()
    assert finish == ("stop" if tokens[-1] in tok.eos_ids else "length")
    assert deltas > 1  # streamed: more than the final delta (2 steps at a time)
    np.testing.assert_allclose(logprobs, np.asarray(want.behavior_logp[0, :n]), atol=1e-5)
    assert [t[0][0] for t in top] == tokens and all(len(t) == 2 for t in top)


def test_seeded_choices_repeat_and_differ_from_each_other(tiny):
    _, _, backend = tiny
    request = Request(PROMPT, max_new=12, n=2, temperature=1.0, seed=123)
    first, second = _collect(backend, [request, request])
    assert first[0][0] == second[0][0] and first[1][0] == second[1][0]
    assert first[0][0] != first[1][0]  # the choices of one request draw apart


def test_long_prompts_cancels_and_a_full_queue(tiny):
    _, _, backend = tiny
    # A 12-token prompt over 8 prompt columns: the rest is fed, never sent back.
    [long] = _collect(backend, [Request(tuple(range(3, 15)), max_new=5, temperature=0.0)])
    assert len(long[0][0]) <= 5 and long[0][3] in ("stop", "length")
    with pytest.raises(ValueError, match="over the context of 32 tokens"):
        backend.submit(Request(PROMPT, max_new=29), asyncio.new_event_loop())
    # Cancelled after 2 tokens: its slots come free, nothing stays busy.
    threads = threading.active_count()
    got = _collect(backend, [Request(PROMPT, max_new=20, n=2, temperature=1.0)] * 3,
                   cancel_after=2)  # fmt: skip
    assert all(len(c[0]) < 20 for r in got for c in r.values())
    deadline = time.monotonic() + 30  # the engine thread takes the cancellations next
    while backend.stats()["slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = backend.stats()
    assert stats["slots_busy"] == 0 and stats["queue_length"] == 0
    assert threading.active_count() == threads


def test_more_waiting_requests_than_the_queue_holds_are_refused(tiny):
    model, tok, _ = tiny
    backend = EngineBackend(model, tok, slots=4, context=32, prompt_len=8, max_queue=3, steps=2)
    loop = asyncio.new_event_loop()
    try:
        submitted = 0
        with pytest.raises(QueueFull, match="requests are waiting for a slot"):
            for _ in range(20):
                backend.submit(Request(PROMPT, max_new=20, n=4), loop)
                submitted += 1
        assert 3 <= submitted < 20  # max_queue 3 waiting, beside what the slots took
    finally:
        backend.close()
        loop.close()


def test_any_max_tokens_that_fits_the_context_is_served(tiny):
    _, _, backend = tiny
    # 4 prompt tokens and 28 new: the whole context of 32, past its prompt_len of 8.
    [got] = _collect(backend, [Request(PROMPT, max_new=28, temperature=1.0, seed=5)])
    tokens, _, _, finish, _ = got[0]
    assert finish == "stop" or len(tokens) == 28


def test_a_cancel_wakes_a_reader_waiting_for_deltas(tiny):
    _, _, backend = tiny

    async def scenario():
        generation = backend.submit(Request(PROMPT, max_new=28, n=2), asyncio.get_running_loop())
        seen = []

        async def read():
            async for d in generation.deltas():
                seen.append(d)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)  # the reader waits on its first delta
        generation.cancel()  # from elsewhere on the loop (a client gone)
        await asyncio.wait_for(reader, timeout=10)
        return seen

    asyncio.run(scenario())  # ends: the reader did not wait forever


def test_on_a_mesh_the_slots_split_over_devices_and_decode_the_same(tiny):
    from jaxrl_scale.config import MeshConfig
    from jaxrl_scale.parallel.sharding import make_mesh, shard_module
    from jaxrl_scale.serving import serving_mesh

    model, tok, one_device = tiny
    assert serving_mesh() is None  # a folder or run as it is: one device
    mesh = serving_mesh(overrides=["mesh.data=4"])
    assert mesh.devices.size == 4 == make_mesh(MeshConfig(data=4)).devices.size
    backend = EngineBackend(shard_module(model, mesh), tok, slots=8, context=32, prompt_len=8,
                            steps=2, mesh=mesh)  # fmt: skip
    try:
        requests = [Request(PROMPT, max_new=12, n=3, temperature=1.0, seed=9),
                    Request((9, 8, 7), max_new=10, temperature=0.0)]  # fmt: skip
        sharded = _collect(backend, requests)
        alone = _collect(one_device, requests)
        for got, want in zip(sharded, alone, strict=True):
            for i in want:
                assert got[i][0] == want[i][0] and got[i][3] == want[i][3]
                np.testing.assert_allclose(got[i][1], want[i][1], atol=1e-5)
    finally:
        backend.close()
    with pytest.raises(ValueError, match="does not split over"):  # 6 slots on 4 shards
        EngineBackend(shard_module(model, mesh), tok, slots=6, context=32, mesh=mesh)


def test_after_warm_up_no_traffic_compiles_a_program(tiny):
    """Warmed up, any mix of requests (counts, long prompts fed as given tokens, top
    alternatives, choices, cancels) runs on programs already compiled: a server's first
    requests of a new shape do not wait for XLA. The geometry is this test's own, so no
    earlier test compiled its programs."""
    import jax

    model, tok, _ = tiny
    compiles = []

    def count(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    backend = EngineBackend(model, tok, slots=8, context=40, prompt_len=8, max_queue=64,
                            steps=3, warm_up=True)  # fmt: skip
    try:
        warmed = len(compiles)
        assert warmed > 5  # it compiled: nothing was in the cache for this geometry
        rng = np.random.default_rng(0)
        for wave in (1, 3, 8, 13, 2, 30):  # admissions of every width, rows read in any number
            requests = []
            for _ in range(wave):
                prompt = tuple(int(t) for t in rng.integers(3, 200, int(rng.integers(1, 24))))
                requests.append(Request(
                    prompt, max_new=int(rng.integers(1, 40 - len(prompt))),
                    n=int(rng.integers(1, 3)), temperature=float(rng.choice([0.0, 1.0])),
                    top_logprobs=int(rng.choice([0, 3])), seed=wave,
                ))  # fmt: skip
            _collect(backend, requests, cancel_after=int(rng.integers(2, 6)) if wave % 2 else None)
        assert len(compiles) == warmed, f"{len(compiles) - warmed} programs compiled by traffic"
    finally:
        backend.close()
        jax.monitoring.unregister_event_duration_listener(count)


def test_deltas_that_arrived_meanwhile_come_as_one_per_choice():
    """A reader behind its backend gets what piled up as one delta per choice, each choice's
    tokens in order, a finish kept, and an error after the deltas before it."""
    from jaxrl_scale.serve.backend import Delta, Generation

    class Quiet:  # only Generation's own behaviour is under test here
        def cancel(self, generation, choices):
            pass

    async def scenario(items):
        g = Generation(Request(PROMPT, max_new=9, n=2, top_logprobs=1), asyncio.get_running_loop(),
                       Quiet())  # fmt: skip
        for item in items:
            g.push(item)
        await asyncio.sleep(0.01)  # every push lands before the first read
        got = []
        with contextlib.suppress(RuntimeError):
            async for d in g.deltas():
                got.append(d)
        return got

    top = lambda *ids: tuple(((i, -1.0),) for i in ids)  # noqa: E731
    got = asyncio.run(scenario([
        Delta(0, (1, 2), (-1.0, -2.0), top(1, 2)),
        Delta(1, (7,), (-7.0,), top(7)),
        Delta(0, (3,), (-3.0,), top(3), "stop"),
        Delta(1, (8, 9), (-8.0, -9.0), top(8, 9), "length"),
    ]))  # fmt: skip
    assert got == [Delta(0, (1, 2, 3), (-1.0, -2.0, -3.0), top(1, 2, 3), "stop"),
                   Delta(1, (7, 8, 9), (-7.0, -8.0, -9.0), top(7, 8, 9), "length")]  # fmt: skip
    pushed = [Delta(0, (1,), (-1.0,)), RuntimeError("engine"), Delta(0, (2,), (-2.0,))]
    got = asyncio.run(scenario(pushed))
    assert got == [Delta(0, (1,), (-1.0,))]  # the error ends the reading after what came before


def test_a_request_held_for_a_newer_version_does_not_hold_the_ones_behind_it(tiny):
    """A server's requests are independent: one held for a policy version the engine has not
    reached (an agent episode of a training batch ahead) leaves the slots to those queued
    after it (the other episodes' next calls)."""
    _, _, backend = tiny

    async def scenario():
        loop = asyncio.get_running_loop()
        held = backend.submit(Request(PROMPT, max_new=4, not_before=5), loop)
        free = backend.submit(Request(PROMPT, max_new=4, temperature=0.0), loop)
        got = [d async for d in free.deltas()]  # (before the fix: waited behind `held`)
        assert held.open == {0}  # never admitted: its version never comes
        held.cancel()
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert got[-1].finish in ("stop", "length")
    wait_idle = time.monotonic() + 30
    while backend.stats()["queue_length"] and time.monotonic() < wait_idle:
        time.sleep(0.01)
    assert backend.stats()["queue_length"] == 0  # the cancelled one left the queue
