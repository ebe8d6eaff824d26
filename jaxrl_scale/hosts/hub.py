"""The trainer's side of a run across hosts: the hub that hands prompts to generator jobs and
takes their scored batches back, and the feeder the train loop reads them from.

    trainer process 0                                  generator group g (its own job)
    Hub (thread): ZeroMQ ROUTER  <-- join / work / beat (JSON) --   HubClient
                  ZeroMQ PULL    <-- scored batch (JSON + .npz) --   (PUSH)
    every trainer process: WeightServer (weights.py) <-- pull over jax.experimental.transfer

Why ZeroMQ: the generator groups are separate jobs (a `jax.distributed` job whose process
dies takes the whole job down with it, and its key-value store is only for processes of one
job), so the control channel must outlive any one of them. ZeroMQ reconnects by itself, queues
while a peer restarts, and needs no schema compiler; every message is JSON, and the one bulk
message (a scored batch, which the verifier already needed on the host) travels on its own
socket as a NumPy .npz frame. Weights never touch it.

Order and the bound. Batches are numbered from the run's first step; batch n is the (n+1)-th
the trainer takes, after n updates. The hub hands batch n out only once the trainer has
published version start + n - k, and its tokens must all carry versions at least that
(`oldest`): the ahead side waits, so nothing is generated to be thrown away. The trainer takes
batches in number order. A group silent for `hosts.lost_after` seconds is lost: its batch's
prompts are handed out again (same prompts, same number) and its rows counted (`lost_rows`).

Ownership. The hub thread owns its sockets, the generator table and the curriculum after the
feeder starts (it draws prompts when handing out and records pass rates when a batch arrives,
as the generator thread does in one process); the trainer's main thread reads arrived batches
and publishes versions through `_cond`.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import zmq
from jax.experimental import multihost_utils

from jaxrl_scale.generation.sampler import Rollout
from jaxrl_scale.hosts.weights import WeightServer
from jaxrl_scale.parallel import distributed
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.rollout import Rollouts, Scored

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


ROLLOUT_FIELDS = tuple(f for f in Rollout.__dataclass_fields__)


def encode_batch(header: dict, scored_arrays: dict[str, np.ndarray]) -> list[bytes]:
    """A scored batch as two frames: a JSON header and an .npz of its arrays (no pickle)."""
    buf = io.BytesIO()
    np.savez(buf, **scored_arrays)
    return [json.dumps(header).encode(), buf.getvalue()]


def decode_arrays(frame: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(frame), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def check_batch(cfg: ExperimentConfig, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """A scored batch from a generator group is whole before the trainer takes it: every
    array a batch carries, with its rows (prompts x group size) or prompts first; a header
    with its statistics and seconds. ValueError naming what is wrong."""
    rows, prompts = cfg.train.prompts_per_step * cfg.train.group_size, cfg.train.prompts_per_step
    need = {f: rows for f in ROLLOUT_FIELDS if f != "routes"}  # routes: router replay only
    need.update(rewards=rows, pass_rates=prompts, indices=prompts)
    if "routes" in arrays:
        need["routes"] = rows
    missing = sorted(set(need) - set(arrays))
    if missing:
        raise ValueError(f"the batch has no {', '.join(missing)}")
    for name, first in need.items():
        shape = arrays[name].shape
        if not shape or shape[0] != first:
            raise ValueError(f"{name} has shape {shape}, expected {first} first")
    if not isinstance(header.get("stats"), dict):
        raise ValueError("the header has no stats")
    if not isinstance(header.get("seconds"), int | float):
        raise ValueError("the header has no seconds")


def dispatch_key(cfg: ExperimentConfig, number: int) -> int:
    """What the batch with this number (counted from step 0) folds into the run's key: the
    same as the one-process feeders (sync: the round; the others: 2**20 + n)."""
    return number if cfg.pipeline.mode == "sync" else 2**20 + number


class Dispatch:
    """Which batch goes to whom: numbers, prompts (drawn from the curriculum as they are
    handed out, pass rates recorded in batch order as batches arrive), the staleness bound and fixed
    schedules, batches handed out again. Owned by the hub thread."""

    def __init__(self, cfg: ExperimentConfig, curriculum: Curriculum, *, start: int, k: int,
                 chunks: int):  # fmt: skip
        self.cfg, self.curriculum, self.start, self.k = cfg, curriculum, start, k
        self.swap_at = -(-chunks // 2)
        self.next = 0  # the next batch number to draw
        self.assigned: dict[int, dict] = {}  # n -> {"indices", "gen"}: not arrived yet
        self.redraw: list[int] = []  # numbers whose group was lost, to hand out first
        self.cursors: dict[int, tuple[int, int]] = {}  # n -> curriculum cursor before its draw
        self.early: dict[int, tuple] = {}  # arrived before a batch ahead of them: (indices, rates)
        self.applied = 0  # batches 0..applied-1 have their pass rates in the curriculum

    def assign(self, gen_id: int, published: int) -> dict | None:
        """The next batch for generator `gen_id`, or None while the bound holds it back."""
        if self.redraw:
            n = self.redraw.pop(0)
        else:
            n = self.next
            if published < self.start + n - self.k or self.start + n >= self.cfg.train.steps:
                return None  # ahead of the bound (the ahead side waits), or nothing left
            if self.cfg.pipeline.lockstep and n - 1 in self.assigned:
                return None  # a fixed schedule: drawn after the batch before was scored
            cursor = (self.curriculum.epoch, self.curriculum.position)
            indices = self.curriculum.next_batch(self.cfg.train.prompts_per_step)
            self.assigned[n] = {"indices": indices}
            self.cursors[n] = cursor
            self.next += 1
        self.assigned[n]["gen"] = gen_id
        version = self.start + n
        if self.cfg.pipeline.mode == "sync":
            schedule = [version, version]
        elif self.cfg.pipeline.lockstep:
            schedule = [max(version - 1, self.start), version]
        else:
            schedule = None
        return {"batch": n, "indices": self.assigned[n]["indices"].tolist(),
                "oldest": version - self.k, "key": dispatch_key(self.cfg, version),
                "schedule": schedule, "swap_at": self.swap_at}  # fmt: skip

    def requeue(self, numbers: list[int], gen_id: int) -> list[int]:
        """Hand `gen_id`'s batches among `numbers` out again; the numbers requeued."""
        mine = sorted(n for n in numbers if self.assigned.get(n, {}).get("gen") == gen_id)
        for n in mine:
            self.assigned[n]["gen"] = None
            self.redraw = sorted({*self.redraw, n})
        return mine

    def accept(self, gen_id: int, n: int, pass_rates) -> list[tuple[int, dict]] | None:
        """Batch n arrived from `gen_id` (None if it was not that generator's to make): the
        batches whose pass rates are now in the curriculum, in order, each with the
        curriculum snapshot a checkpoint after training it keeps. Pass rates go in in batch
        order, so a batch that arrives before one ahead of it waits for it: the snapshot of
        batch m holds the pass rates of batches up to m, none later (a resumed run draws
        those again)."""
        assignment = self.assigned.get(n)
        if assignment is None or assignment["gen"] != gen_id:
            return None
        del self.assigned[n]
        self.early[n] = (assignment["indices"], pass_rates)
        ready = []
        while self.applied in self.early:
            m = self.applied
            self.curriculum.update(*self.early.pop(m))
            snapshot = self.curriculum.state_dict()
            later = [cursor for k, cursor in self.cursors.items() if k > m]  # arrived or not
            if later:  # batches drawn after this one are drawn again by a resumed run
                snapshot["epoch"], snapshot["position"] = map(np.asarray, min(later))
            ready.append((m, snapshot))
            self.applied += 1
        # A cursor serves the batches drawn before it whose pass rates are not in yet.
        self.cursors = {k: c for k, c in self.cursors.items() if k > self.applied}
        return ready


class Hub:
    """Trainer process 0's control endpoint (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, curriculum: Curriculum, *, start: int, k: int,
                 chunks: int, weights: list[dict]):  # fmt: skip
        self.cfg = cfg
        self.dispatch = Dispatch(cfg, curriculum, start=start, k=k, chunks=chunks)
        self.weights = weights
        self.run = secrets.token_hex(8)  # a restarted trainer is a new run to the generators
        self.rows = cfg.train.prompts_per_step * cfg.train.group_size
        self._cond = threading.Condition()
        self._published = start  # guarded by _cond (written by the trainer thread)
        self._arrived: dict[int, tuple[dict, dict, dict]] = {}  # n -> (header, arrays, curric.)
        self._early: dict[int, tuple[dict, dict]] = {}  # guarded by _cond: arrived, an
        # earlier batch not yet (hub thread writes, the trainer thread counts them)
        self._stopping: float | None = None  # when stopping: the time the hub thread ends by
        self._failed: BaseException | None = None
        self.lost_rows = self.lost_batches = self.rejected = 0  # hub thread; read when joined
        # Hub thread only:
        self._gens: dict[int, dict] = {}
        self._joins: dict[str, int] = {}  # join token -> generator id
        self._gen_ids = iter(range(1, 2**31))
        self._last_heard = time.monotonic()
        self.stopped_told: set[int] = set()  # generators told to stop
        context = zmq.Context.instance()
        host, port = cfg.hosts.hub.rsplit(":", 1)
        self._control = context.socket(zmq.ROUTER)
        self._data = context.socket(zmq.PULL)
        for s in (self._control, self._data):
            s.setsockopt(zmq.LINGER, 0)
        self._control.bind(f"tcp://{host}:{port}")
        self._data.bind(f"tcp://{host}:{int(port) + 1}")
        self._thread = threading.Thread(target=self._serve, name="hub", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer thread

    def published(self, version: int) -> None:
        with self._cond:
            self._published = version
            self._cond.notify_all()

    def take(self, number: int) -> tuple[dict, dict, dict]:
        """Batch `number` once it arrived: (header, arrays, curriculum snapshot)."""
        timeout = self.cfg.hosts.timeout
        with self._cond:
            while number not in self._arrived:
                if self._failed is not None:
                    raise RuntimeError("the trainer's hub failed") from self._failed
                self._cond.wait(timeout=0.5)
                silent = time.monotonic() - self._last_heard
                if silent > timeout:
                    raise TimeoutError(
                        f"trainer hub {self.cfg.hosts.hub}: no generator group has been heard "
                        f"from for {silent:.0f} s while waiting for batch {number} "
                        f"(last seen: {self._describe_gens()})"
                    )
            return self._arrived.pop(number)

    def has(self, number: int) -> bool:
        with self._cond:
            return number in self._arrived

    def in_flight(self) -> int:
        with self._cond:
            return len(self._arrived) + len(self._early) + len(self.dispatch.assigned)

    def stop(self, grace: float = 3.0) -> None:
        """Tell generators to stop (each is told at its next request), then close."""
        with self._cond:
            self._stopping = time.monotonic() + grace  # the hub thread ends by then
        self._thread.join(timeout=grace + 5)

    # ------------------------------------------------------------------ hub thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        poller.register(self._data, zmq.POLLIN)
        try:
            while True:
                with self._cond:
                    ends = self._stopping
                if ends and (time.monotonic() > ends or not set(self._gens) - self.stopped_told):
                    return
                events = dict(poller.poll(50))
                if self._control in events:
                    *envelope, raw = self._control.recv_multipart()  # peer, request id, b""
                    reply = self._answer(raw)
                    self._control.send_multipart([*envelope, json.dumps(reply).encode()])
                if self._data in events:
                    self._receive(self._data.recv_multipart())
                self._find_lost()
        except BaseException as e:  # surfaced in the trainer thread
            with self._cond:
                self._failed = e
                self._cond.notify_all()
            raise
        finally:
            self._control.close()
            self._data.close()

    def _answer(self, raw: bytes) -> dict:
        try:
            msg = json.loads(raw)
            op = msg["op"]
        except (ValueError, KeyError, TypeError):
            return {"error": "bad message"}
        now = time.monotonic()
        if op == "join":
            gen = self._joins.get(msg.get("token"))
            if gen is not None and gen in self._gens:  # the same join, asked again
                return {"run": self.run, "gen": gen, "weights": self.weights,
                        "version": self._published_now()}  # fmt: skip
            gen = next(self._gen_ids)
            self._joins[msg.get("token")] = gen
            self._gens[gen] = {"group": msg.get("group"), "host": msg.get("host"),
                               "seen": now, "batches": set(), "seq": None}  # fmt: skip
            self._heard()
            print(f"hub: generator group {msg.get('group')} on {msg.get('host')} joined",
                  file=sys.stderr, flush=True)  # fmt: skip
            return {"run": self.run, "gen": gen, "weights": self.weights,
                    "version": self._published_now()}  # fmt: skip
        gen = self._gens.get(msg.get("gen")) if msg.get("run") == self.run else None
        if gen is None:
            return {"rejoin": True, "run": self.run}
        gen["seen"] = now
        self._heard()
        with self._cond:
            stopping = self._stopping
        if stopping:
            self.stopped_told.add(msg["gen"])
            return {"stop": True}
        if op == "beat":
            return {"version": self._published_now()}
        if op == "work":  # a retried request (same seq) gets the same answer
            if msg.get("seq") is None or msg["seq"] != gen["seq"]:
                reply = self.dispatch.assign(msg["gen"], self._published_now())
                gen["seq"], gen["reply"] = msg.get("seq"), reply
                if reply is not None:
                    gen["batches"].add(reply["batch"])  # until it arrives
            return gen["reply"] or {"wait": 0.05}
        if op == "leave":
            self._lose(msg["gen"], "left")
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def _published_now(self) -> int:
        with self._cond:
            return self._published

    def _heard(self) -> None:
        with self._cond:
            self._last_heard = time.monotonic()

    def _receive(self, frames: list[bytes]) -> None:
        try:
            header = json.loads(frames[0])
            gen_id, n = header["gen"], int(header["batch"])
            arrays = decode_arrays(frames[1])
            check_batch(self.cfg, header, arrays)
        except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
            self.rejected += 1
            print(f"hub: a malformed batch was dropped ({e}); {self.rejected} so far",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        ready = None
        if header.get("run") == self.run:
            ready = self.dispatch.accept(gen_id, n, arrays["pass_rates"])
        if ready is None:
            self.rejected += 1  # from a trainer before a restart, or a group counted lost
            print(f"hub: batch {n} from generator {gen_id} was not this run's to make; dropped "
                  f"({self.rejected} so far)", file=sys.stderr, flush=True)  # fmt: skip
            return
        if gen_id in self._gens:
            self._gens[gen_id]["batches"].discard(n)
            self._gens[gen_id]["seen"] = time.monotonic()
        with self._cond:
            self._early[n] = (header, arrays)
            for m, snapshot in ready:  # in order: their pass rates are in the curriculum
                self._arrived[m] = (*self._early.pop(m), snapshot)
            self._cond.notify_all()

    def _find_lost(self) -> None:
        now = time.monotonic()
        for gen_id, gen in list(self._gens.items()):
            if now - gen["seen"] > self.cfg.hosts.lost_after:
                self._lose(gen_id, f"silent for {now - gen['seen']:.0f} s")

    def _lose(self, gen_id: int, why: str) -> None:
        gen = self._gens.pop(gen_id)
        mine = self.dispatch.requeue(sorted(gen["batches"]), gen_id)
        self.lost_rows += self.rows * len(mine)
        self.lost_batches += len(mine)
        lost = f"; its batch(es) {mine} ({self.rows * len(mine)} rows) are handed out again"
        print(f"hub: generator group {gen['group']} on {gen['host']} {why}{lost}",
              file=sys.stderr, flush=True)  # fmt: skip

    def _describe_gens(self) -> str:
        now = time.monotonic()
        gens = [f"group {g['group']} on {g['host']} {now - g['seen']:.0f} s ago"
                for g in list(self._gens.values())]  # fmt: skip
        return ", ".join(gens) or "none joined"


class RemoteFeeder:
    """The train loop's feeder when generators are separate jobs (`hosts.generator_groups`):
    batch n is taken from the hub (process 0) and broadcast to the other trainer processes;
    every trainer process publishes each version to its weight server. The interface is
    pipeline.py's feeders'."""

    def __init__(self, cfg: ExperimentConfig, worker, params, *, version: int, k: int):
        self.cfg, self.worker, self.start, self.k = cfg, worker, version, k
        self.taken = 0
        self.pending: list[Any] = []  # in flight on other hosts: drawn again on resume
        self.dropped: list[Any] = []
        host = address(cfg)
        gen_devices = generator_devices(cfg)
        self.weights = WeightServer(worker.mesh, cfg.model, gen_devices, host=host,
                                    timeout=cfg.hosts.timeout)  # fmt: skip
        self.weights.publish(version, params)  # what generators start from
        everyone = _allgather_json(self.weights.address)
        self.hub = None
        if distributed.is_main():
            self.hub = Hub(cfg, worker.curriculum, start=version, k=k, chunks=worker.chunks,
                           weights=everyone)  # fmt: skip
        self._lost_counted = 0

    def ready(self) -> bool:
        return self.hub is not None and self.hub.has(self.taken)

    def next(self) -> Rollouts:
        n = self.taken
        frames = None
        key = f"jaxrl_scale/batch/{self.start + n}"
        if self.hub is not None:
            header, arrays, curriculum = self.hub.take(n)
            frames = encode_batch({"header": header}, {**arrays, **{
                f"curriculum.{k}": np.asarray(v) for k, v in curriculum.items()}})  # fmt: skip
            distributed.announce(key)
        else:  # wait outside any collective: generation may take longer than one may wait
            distributed.wait_for(key, self.cfg.hosts.timeout * 4, f"batch {n} from the hub")
        frames = _broadcast_frames(frames)
        header = json.loads(frames[0])["header"]
        arrays = decode_arrays(frames[1])
        curriculum = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("curr")}
        ro = Rollout(**{f: arrays.get(f) for f in ROLLOUT_FIELDS})  # routes: if replayed
        scored = Scored(ro, arrays["rewards"], arrays["versions"], arrays["pass_rates"],
                        dict(header["stats"]))  # fmt: skip
        self.taken += 1
        return self.worker.assemble(scored, arrays["indices"], curriculum, header["seconds"])

    def trained(self, params, version: int) -> None:
        self.weights.publish(version, params)
        if self.hub is not None:
            self.hub.published(version)

    def take_dropped(self) -> list[Any]:
        out, self.dropped = self.dropped, []
        return out

    def take_lost_rows(self) -> int:
        """Rows lost generator groups had in flight since the last call (process 0 knows)."""
        if self.hub is None:
            return 0
        lost = self.hub.lost_rows - self._lost_counted
        self._lost_counted = self.hub.lost_rows
        return lost

    def stop(self) -> None:
        if self.hub is not None:
            self.hub.stop()
        self.weights.close()

    def untrained(self) -> int:
        return 0 if self.hub is None else self.hub.in_flight()


def address(cfg: ExperimentConfig, *, trainer: bool = True) -> str:
    """Where other hosts reach this process: `hosts.address`, JAXRL_HOST, loopback for a hub
    on loopback, the hub's host on the trainer's process 0, else this host's name."""
    if cfg.hosts.address or os.environ.get("JAXRL_HOST"):
        return cfg.hosts.address or os.environ["JAXRL_HOST"]
    hub_host = cfg.hosts.hub.rsplit(":", 1)[0]
    if hub_host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return hub_host if trainer and distributed.is_main() else socket.gethostname()


def generator_devices(cfg: ExperimentConfig) -> int:
    """Devices in each generator group's mesh (`hosts.generator_mesh`); an axis of -1 counts
    as many devices as a trainer host has (the trainer cannot see the groups' devices)."""
    m = cfg.hosts.generator_mesh
    sizes = [m.data, m.fsdp, m.expert, m.tensor]
    if -1 in sizes:
        sizes[sizes.index(-1)] = jax.local_device_count() // max(1, -int(np.prod(sizes)))
    return int(np.prod(sizes))


def _allgather_json(value: dict) -> list[dict]:
    """Every trainer process's `value`, in process order."""
    if jax.process_count() == 1:
        return [value]
    raw = json.dumps(value).encode()
    if len(raw) > 4096:
        raise ValueError(f"a trainer process's addresses take {len(raw)} bytes (at most 4096)")
    raw = raw.ljust(4096)
    got = multihost_utils.process_allgather(np.frombuffer(raw, np.uint8))
    return [json.loads(bytes(row).decode().strip()) for row in np.asarray(got)]


def broadcast_bucket(n: int) -> int:
    """The bytes a batch of `n` bytes is broadcast in: at least 64 KiB, else `n` rounded up
    to an eighth of its power of two (at most 12.5% more). Every distinct length compiles
    the broadcast again; batches' lengths vary with their header and their rows, and fall
    in a few of these buckets."""
    if n <= 1 << 16:
        return 1 << 16
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _broadcast_frames(frames: list[bytes] | None) -> list[bytes]:
    """Process 0's frames on every trainer process (a collective over the trainer's job)."""
    if jax.process_count() == 1:
        return frames
    sizes = np.zeros(2, np.int64) if frames is None else np.array([len(f) for f in frames])
    sizes = np.asarray(multihost_utils.broadcast_one_to_all(sizes))
    joined = np.zeros(broadcast_bucket(int(sizes.sum())), np.uint8)
    if frames is not None:
        data = b"".join(frames)
        joined[: len(data)] = np.frombuffer(data, np.uint8)
    joined = np.asarray(multihost_utils.broadcast_one_to_all(joined))[: int(sizes.sum())]
    joined = joined.tobytes()
    return [joined[: sizes[0]], joined[sizes[0] :]]
