"""The staleness-bounded rollout buffer, without JAX: capacity, staleness, errors."""

import queue
import threading
import time

import numpy as np
import pytest

from jaxrl_scale.rl.buffer import RolloutBuffer, oldest_version


def _versions(*vs):
    """Per-token versions of one batch: two rows, padding (-1) after the sampled tokens."""
    return np.array([[*vs, -1], [vs[-1]] * len(vs) + [-1]])


def test_oldest_version_ignores_unsampled_slots():
    assert oldest_version(_versions(3, 4)) == 3
    assert oldest_version(np.full((2, 3), -1)) is None


def test_batches_more_than_k_versions_old_are_dropped():
    buf = RolloutBuffer(max_staleness=2, capacity=4)
    for name, vs in [("v0", (0, 1)), ("v1", (1, 1)), ("v3", (3, 4)), ("none", (-1,))]:
        buf.put(name, _versions(*vs))
    # At version 3: v0 is 3 behind (dropped), v1 is 2 behind (the bound, kept).
    assert buf.get(3) == "v1" and buf.dropped == 1
    assert buf.get(5) == "v3"  # its oldest token is version 3: 2 behind
    assert buf.get(100) == "none"  # nothing sampled (e.g. all interrupted text): never stale
    with pytest.raises(queue.Empty):
        buf.get(0, timeout=0.05)


def test_a_full_buffer_makes_the_producer_wait():
    buf = RolloutBuffer(max_staleness=8, capacity=2)
    assert buf.put("a", _versions(0)) and buf.put("b", _versions(0))
    halt = threading.Event()
    result = {}
    producer = threading.Thread(
        target=lambda: result.setdefault("ok", buf.put("c", _versions(0), halt=halt))
    )
    producer.start()
    time.sleep(0.3)
    assert producer.is_alive()  # blocked: two batches ahead already
    assert buf.get(0) == "a"
    producer.join(timeout=5)
    assert result["ok"] is True and [buf.get(0), buf.get(0)] == ["b", "c"]
    # A producer told to halt while waiting gives up without adding.
    buf.put("d", _versions(0)), buf.put("e", _versions(0))
    halt.set()
    assert buf.put("f", _versions(0), halt=halt) is False


def test_a_producer_failure_reaches_the_consumer():
    buf = RolloutBuffer(max_staleness=1)
    buf.put_error(ValueError("verifier crashed"))
    with pytest.raises(RuntimeError, match="producer failed") as info:
        buf.get(0)
    assert isinstance(info.value.__cause__, ValueError)


def test_capacity_defaults_to_k():
    assert RolloutBuffer(max_staleness=3)._queue.maxsize == 3
    assert RolloutBuffer(max_staleness=0)._queue.maxsize == 1
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(max_staleness=-1)


def test_ready_says_whether_get_would_wait():
    buf = RolloutBuffer(max_staleness=1)
    assert not buf.ready()
    buf.put("a", _versions(0))
    assert buf.ready() and buf.get(0) == "a" and not buf.ready()
    buf.put_error(ValueError("x"))
    assert buf.ready()  # get raises at once
