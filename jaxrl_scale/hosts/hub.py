"""The trainer's side of a run across hosts: the hub that hands prompts to generator jobs and
takes their scored batches back, and the feeder the train loop reads them from.

    trainer process 0                                  generator group g (its own job)
    Hub (thread): ZeroMQ ROUTER  <-- join / work / beat / fail --   HubClient
                  ZeroMQ PULL    <-- scored batch (JSON + .npz) --   (PUSH)
    every trainer process: WeightServer (weights.py) <-- pull over jax.experimental.transfer
    trainer process 0: BatchServer (REP) --> a taken batch's bytes to processes 1..T-1

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
A group that fails for good ("fail": `weights.PermanentFailure`, a config that differs, or
`tasks.scoring.ScorerBroken`, its scoring broken) ends the trainer's wait, and so its run,
with that error.

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
from jaxrl_scale.hosts.weights import PermanentFailure, WeightServer
from jaxrl_scale.parallel import distributed
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.rollout import Rollouts, Scored, held_out_row
from jaxrl_scale.tasks.scoring import ScorerBroken

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
        # Held-out evaluations the trainer waits for, guarded by _cond: id -> {"version",
        # "key", "parts": [(lo, hi)], "todo": parts not handed out, "assigned": part -> gen,
        # "results": part -> (scores, counts)} (trainer thread adds, hub thread fills).
        self._evals: dict[int, dict] = {}
        self._eval_ids = iter(range(2**31))
        self._stopping: float | None = None  # when stopping: the time the hub thread ends by
        self._failed: BaseException | None = None
        # A group's failure that would repeat (its message names the key, or the scorer's
        # failure), guarded by _cond: the trainer's wait ends with it.
        self._group_failed: PermanentFailure | ScorerBroken | None = None
        self._processes = 0  # guarded by _cond: the processes of the live groups (each once)
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
        with self._cond:
            self._wait(lambda: number in self._arrived, f"batch {number}")
            return self._arrived.pop(number)

    def _wait(self, done, what: str) -> None:
        """Wait (holding `_cond`) until `done()`: a failed hub thread raises, and so does no
        generator group heard from for `hosts.timeout` seconds, naming `what` and the groups."""
        while not done():
            if self._failed is not None:
                raise RuntimeError("the trainer's hub failed") from self._failed
            if self._group_failed is not None:
                raise self._group_failed
            self._cond.wait(timeout=0.5)
            silent = time.monotonic() - self._last_heard
            if silent > self.cfg.hosts.timeout:
                raise TimeoutError(
                    f"trainer hub {self.cfg.hosts.hub}: no generator group has been heard from "
                    f"for {silent:.0f} s while waiting for {what} (last seen: "
                    f"{self._describe_gens()})"
                )

    def evaluate(self, version: int, key: list[int], parts: list[tuple[int, int]]) -> list:
        """A held-out evaluation of `version` by the generator groups: part j, the held-out
        examples parts[j] = (lo, hi), goes to the next group asking for work (before any
        batch), decoded with exactly that version and sampling key `key` (the key's data;
        folded with j where there are several parts). Each part's (scores [hi - lo, k],
        counts), once all arrived; a part whose group is lost is handed out again."""
        with self._cond:
            e = next(self._eval_ids)
            self._evals[e] = {"version": version, "key": key, "parts": parts, "assigned": {},
                              "todo": list(range(len(parts))), "results": {}}  # fmt: skip
            job = self._evals[e]
            try:
                self._wait(lambda: len(job["results"]) == len(parts),
                           f"the held-out evaluation of version {version}")  # fmt: skip
            finally:
                del self._evals[e]
        return [job["results"][j] for j in range(len(parts))]

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
        if op == "fail":  # a failure the group would meet again however often it rejoined
            failure = ScorerBroken if msg.get("kind") == "scoring" else PermanentFailure
            error = failure(
                f"{msg.get('error')} (generator group {msg.get('group')} on {msg.get('host')})"
            )
            print(f"hub: {error}; the run ends", file=sys.stderr, flush=True)
            with self._cond:
                self._group_failed = error
                self._cond.notify_all()
            return {"ok": True}
        if op == "join":
            gen = self._joins.get(msg.get("token"))
            if gen is not None and gen in self._gens:  # the same join, asked again
                return {"run": self.run, "gen": gen, "weights": self.weights,
                        "version": self._published_now()}  # fmt: skip
            gen = next(self._gen_ids)
            self._joins[msg.get("token")] = gen
            processes = msg.get("processes")
            processes = processes if isinstance(processes, int) and processes > 0 else 1
            self._gens[gen] = {"group": msg.get("group"), "host": msg.get("host"),
                               "seen": now, "batches": set(), "seq": None, "progress": None,
                               "progressed": now, "processes": processes}  # fmt: skip
            self._count_processes()
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
            if msg.get("progress") != gen["progress"]:
                gen["progress"], gen["progressed"] = msg.get("progress"), now
            return {"version": self._published_now()}
        if op == "work":  # a retried request (same seq) gets the same answer
            if msg.get("seq") is None or msg["seq"] != gen["seq"]:
                gen["progressed"] = now  # (what it had is done; what it gets starts now)
                # A part of an evaluation the trainer waits for comes before any batch.
                reply = self._eval_part(msg["gen"])
                if reply is None:
                    reply = self.dispatch.assign(msg["gen"], self._published_now())
                    if reply is not None:
                        gen["batches"].add(reply["batch"])  # until it arrives
                gen["seq"], gen["reply"] = msg.get("seq"), reply
            return gen["reply"] or {"wait": 0.05}
        if op == "leave":  # a drained group: what it sent must arrive before it is let go
            if self._unarrived(msg["gen"], msg):
                return {"wait": 0.05}
            self._lose(msg["gen"], "left (drained)")
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def _eval_part(self, gen_id: int) -> dict | None:
        with self._cond:
            for e, job in self._evals.items():
                if job["todo"]:
                    j = job["todo"].pop(0)
                    job["assigned"][j] = gen_id
                    lo, hi = job["parts"][j]
                    return {"eval": e, "part": j, "lo": lo, "hi": hi, "version": job["version"],
                            "key": job["key"], "parts": len(job["parts"])}  # fmt: skip
        return None

    def _receive_eval(self, header: dict, frames: list[bytes]) -> None:
        """A part of a held-out evaluation: its scores [examples of the part, k] and counts."""
        try:
            gen_id, e, j = header["gen"], int(header["eval"]), int(header["part"])
            scores = decode_arrays(frames[1])["scores"]
            counts = dict(header["counts"])
            if not all(isinstance(v, int | float) for v in counts.values()):
                raise ValueError("its counts are not numbers")
        except (ValueError, KeyError, TypeError, IndexError, OSError) as err:
            self.rejected += 1
            print(f"hub: a malformed evaluation was dropped ({err}); {self.rejected} so far",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        with self._cond:
            job = self._evals.get(e) if header.get("run") == self.run else None
            ok = job is not None and job["assigned"].get(j) == gen_id and j not in job["results"]
            if ok:
                lo, hi = job["parts"][j]
                want = (hi - lo, self.cfg.train.eval_samples)
                if scores.shape != want:
                    self.rejected += 1  # dropped, and the part handed out again
                    print(f"hub: evaluation part {j} has scores of shape {scores.shape}, "
                          f"expected {want}; dropped ({self.rejected} so far) and handed out "
                          "again", file=sys.stderr, flush=True)  # fmt: skip
                    del job["assigned"][j]
                    job["todo"].append(j)
                    return
                job["results"][j] = (scores, counts)
                self._cond.notify_all()
        if not ok:
            self.rejected += 1
            print(f"hub: evaluation {e} part {j} from generator {gen_id} was not this run's "
                  f"to make; dropped ({self.rejected} so far)", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _published_now(self) -> int:
        with self._cond:
            return self._published

    def _heard(self) -> None:
        with self._cond:
            self._last_heard = time.monotonic()

    def _receive(self, frames: list[bytes]) -> None:
        try:
            header = json.loads(frames[0])
            if isinstance(header, dict) and "eval" in header:
                return self._receive_eval(header, frames)
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
        now, hosts = time.monotonic(), self.cfg.hosts
        for gen_id, gen in list(self._gens.items()):
            stalled = now - gen["progressed"]
            if now - gen["seen"] > hosts.lost_after:
                self._lose(gen_id, f"silent for {now - gen['seen']:.0f} s")
            elif stalled > hosts.stalled_after and self._holds_work(gen_id):
                self._lose(gen_id, f"made no progress for {stalled:.0f} s while its heartbeat "
                                   "went on (hosts.stalled_after)")  # fmt: skip

    def _unarrived(self, gen_id: int, leave: dict) -> bool:
        """Whether a batch or an evaluation part the leaving group says it sent (`sent`:
        batch numbers; `sent_evals`: [evaluation, part] pairs) has not arrived yet (it comes
        on the data socket; anything it holds and did not send is handed out again)."""
        try:
            sent = {int(n) for n in leave.get("sent", ())}
            parts = {(int(e), int(j)) for e, j in leave.get("sent_evals", ())}
        except (TypeError, ValueError):
            return False
        if self._gens[gen_id]["batches"] & sent:
            return True
        with self._cond:
            return any(
                job["assigned"].get(j) == gen_id and j not in job["results"]
                for e, job in self._evals.items()
                for (e2, j) in parts
                if e2 == e
            )

    def _holds_work(self, gen_id: int) -> bool:
        """Whether the group has a batch, or a part of an evaluation, not yet back."""
        if self._gens[gen_id]["batches"]:
            return True
        with self._cond:
            return any(
                g == gen_id and j not in job["results"]
                for job in self._evals.values()
                for j, g in job["assigned"].items()
            )

    def _count_processes(self) -> None:
        """Each group's processes once: a group that rejoined (a new id) while its old entry
        waits out `hosts.lost_after` counts as its newest join (ids rise with joins)."""
        newest = {g["group"]: g["processes"] for _, g in sorted(self._gens.items())}
        with self._cond:
            self._processes = sum(newest.values())

    def processes(self) -> int:
        """The processes of the generator groups joined and not lost, each group (by its
        number) counted once (the trainer thread)."""
        with self._cond:
            return self._processes

    def _lose(self, gen_id: int, why: str) -> None:
        gen = self._gens.pop(gen_id)
        self._count_processes()
        mine = self.dispatch.requeue(sorted(gen["batches"]), gen_id)
        self.lost_rows += self.rows * len(mine)
        self.lost_batches += len(mine)
        lost = ""
        if mine:
            lost = f"; its batch(es) {mine} ({self.rows * len(mine)} rows) are handed out again"
        with self._cond:  # and the parts of evaluations it had, not yet back
            for e, job in self._evals.items():
                for j in [j for j, g in job["assigned"].items() if g == gen_id]:
                    if j not in job["results"]:
                        del job["assigned"][j]
                        job["todo"].append(j)
                        lost += f"; evaluation {e} part {j} is handed out again"
        print(f"hub: generator group {gen['group']} on {gen['host']} {why}{lost}",
              file=sys.stderr, flush=True)  # fmt: skip

    def _describe_gens(self) -> str:
        now = time.monotonic()
        gens = [f"group {g['group']} on {g['host']} {now - g['seen']:.0f} s ago"
                for g in list(self._gens.values())]  # fmt: skip
        return ", ".join(gens) or "none joined"


class RemoteFeeder:
    """The train loop's feeder when generators are separate jobs (`hosts.generator_groups`):
    batch n is taken from the hub (process 0), and the other trainer processes fetch its bytes
    from process 0's `BatchServer`;
    every trainer process publishes each version to its weight server. The interface is
    pipeline.py's feeders'."""

    def __init__(self, cfg: ExperimentConfig, worker, params, *, version: int, k: int):
        self.cfg, self.worker, self.start, self.k = cfg, worker, version, k
        self.taken = 0
        self.pending: list[Any] = []  # in flight on other hosts: drawn again on resume
        self.dropped: list[Any] = []
        host = address(cfg)
        self.batches = None
        if distributed.is_main():
            self.batches = BatchServer(host, jax.process_count() - 1, cfg.hosts.timeout)
        gen_devices = generator_devices(cfg)
        self.weights = WeightServer(worker.mesh, cfg.model, gen_devices, host=host,
                                    timeout=cfg.hosts.timeout)  # fmt: skip
        self.weights.publish(version, params)  # what generators start from
        everyone = _allgather_json(self.weights.address)
        main = self.batches.address if self.batches is not None else ""
        self._batch_server = _allgather_json({"batches": main})[0]["batches"]
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
            try:
                header, arrays, curriculum = self.hub.take(n)
            except BaseException:
                distributed.announce(key, "failed")  # the other processes stop waiting
                raise
            # The processes of the live groups as it was taken (the rows' generator_processes).
            header = {**header, "stats": {**header["stats"],
                                          "generator_processes": self.hub.processes()}}  # fmt: skip
            frames = encode_batch({"header": header}, {**arrays, **{
                f"curriculum.{k}": np.asarray(v) for k, v in curriculum.items()}})  # fmt: skip
            self.batches.put(n, frames)
            distributed.announce(key, "ok")
        else:  # wait outside any collective: generation may take longer than one may wait
            if self._wait_for_main(key, f"batch {n} from the hub") != "ok":
                raise RuntimeError(f"trainer process 0 failed to take batch {n} from the hub "
                                   "(its log says why)")  # fmt: skip
            frames = fetch_batch(self._batch_server, n, self.cfg.hosts.timeout)
        header = json.loads(frames[0])["header"]
        arrays = decode_arrays(frames[1])
        curriculum = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("curr")}
        ro = Rollout(**{f: arrays.get(f) for f in ROLLOUT_FIELDS})  # routes: if replayed
        scored = Scored(ro, arrays["rewards"], arrays["versions"], arrays["pass_rates"],
                        dict(header["stats"]))  # fmt: skip
        self.taken += 1
        meta = header.get("meta")  # an agent task's sessions, for rollouts.jsonl
        if not (isinstance(meta, list) and len(meta) == len(scored.rewards)):
            meta = None
        return self.worker.assemble(scored, arrays["indices"], curriculum, header["seconds"],
                                    meta)  # fmt: skip

    def evaluate(self, version: int, key) -> dict[str, float]:
        """The held-out evaluation of `version` (published), made by the generator groups:
        the held-out examples in one part per group the run is planned for
        (`hosts.generator_groups`), each decoded with that version alone; the row
        (`rollout.held_out_row`) on process 0, which alone logs and forecasts ({} on the
        others)."""
        done = f"jaxrl_scale/eval/{version}"
        if self.hub is None:  # waiting in no collective: the groups pull weights from here
            if self._wait_for_main(done, f"the held-out evaluation of version {version}") != "ok":
                raise RuntimeError(f"the held-out evaluation of version {version} failed on "
                                   "trainer process 0 (its log says why)")  # fmt: skip
            return {}
        try:
            row = self._evaluate(version, key)
        except BaseException:
            distributed.announce(done, "failed")
            raise
        distributed.announce(done, "ok")
        return row

    def _wait_for_main(self, key: str, what: str) -> str | None:
        """Wait on a trainer process other than 0 for process 0's announcement of `key`,
        without a limit of its own: process 0 bounds each wait (it fails when no generator
        group has been heard from for hosts.timeout, and says so here), and a process 0 that
        dies ends the whole `jax.distributed` job. A long evaluation, or a slow first batch,
        is waited for, as process 0 waits."""
        while True:
            try:
                return distributed.wait_for(key, self.cfg.hosts.timeout, what)
            except TimeoutError:
                continue

    def _evaluate(self, version: int, key) -> dict[str, float]:
        examples = self.worker.task.eval_examples
        n, parts = len(examples), max(1, min(self.cfg.hosts.generator_groups, len(examples)))
        bounds = [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]
        key_data = np.asarray(jax.random.key_data(key)).tolist()
        results = self.hub.evaluate(version, key_data, bounds)
        scores = np.concatenate([r[0] for r in results])
        counts: dict[str, float] = {}
        for (lo, hi), (_, part) in zip(bounds, results, strict=True):
            for name, v in part.items():  # means weighted by their examples, counts summed
                counts[name] = counts.get(name, 0) + (v * (hi - lo) / n if "_mean" in name else v)
        return held_out_row(scores, counts, examples)

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
        if self.batches is not None:
            self.batches.close()
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


def static_waves(cfg: ExperimentConfig) -> str | None:
    """Why generator jobs decode this run's batches in static waves although
    `sampler.batching` asks for the slot engine (the rows say `gen_batching: static`), or None
    where they run what it asks."""
    if cfg.batching != "continuous":
        return None
    if cfg.pipeline.mode == "sync" or cfg.pipeline.lockstep:
        return ("sampler.batching: continuous, but generator jobs decode each batch in static "
                "waves under a fixed schedule (pipeline.mode sync or pipeline.lockstep: the "
                "batch names each chunk's version; rows: gen_batching static)")  # fmt: skip
    return None


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


class BatchServer:
    """Trainer process 0's batches for the other trainer processes, host to host: a ZeroMQ
    REP socket answers "batch n" with its two frames (JSON header, arrays). Nothing goes
    through a device: a collective broadcast would put every batch's bytes on each trainer
    process's devices (with router replay most of a batch), and compile again for every
    new length. A batch is kept until each of the `readers` processes has taken it.
    `put` runs on the train loop's thread and the socket's thread serves: `_frames` is shared
    by the two, behind `_lock`."""

    def __init__(self, host: str, readers: int, timeout: float):
        self.readers, self.timeout = readers, timeout
        self._frames: dict[int, list[bytes]] = {}
        self._left: dict[int, int] = {}
        self._lock = threading.Lock()
        socket = zmq.Context.instance().socket(zmq.REP)  # owned by the serving thread after this
        socket.setsockopt(zmq.LINGER, 0)
        self.address = f"{host}:{socket.bind_to_random_port(f'tcp://{host}')}"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(socket,), daemon=True,
                                        name="batch-server")  # fmt: skip
        self._thread.start()

    def put(self, n: int, frames: list[bytes]) -> None:
        if self.readers:
            with self._lock:
                self._frames[n], self._left[n] = frames, self.readers

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._frames)

    def _serve(self, socket) -> None:
        try:
            while not self._stopping.is_set():
                if not socket.poll(100):
                    continue
                request = socket.recv()
                try:
                    n = int(json.loads(request)["batch"])
                except (ValueError, KeyError, TypeError) as e:
                    socket.send_multipart([json.dumps({"error": f"bad request: {e}"}).encode()])
                    continue
                with self._lock:
                    frames = self._frames.get(n)
                    if frames is not None:
                        self._left[n] -= 1
                        if not self._left[n]:  # every reader has it
                            del self._frames[n], self._left[n]
                if frames is None:
                    error = {"error": f"batch {n} is not held here", "held": self.held()}
                    socket.send_multipart([json.dumps(error).encode()])
                else:
                    socket.send_multipart([b"{}", *frames], copy=False)
        finally:
            socket.close()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)


def fetch_batch(address: str, n: int, timeout: float) -> list[bytes]:
    """Batch n's frames from trainer process 0's `BatchServer` at `address` (host:port)."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{address}")
        socket.send(json.dumps({"batch": n}).encode())
        if not socket.poll(int(timeout * 1000)):
            raise TimeoutError(
                f"no answer in {timeout:.0f} s from trainer process 0's batch server at "
                f"{address} (batch {n})"
            )
        reply = socket.recv_multipart()
    finally:
        socket.close()
    status = json.loads(reply[0])
    if "error" in status:
        raise RuntimeError(f"trainer process 0's batch server at {address}: {status['error']}")
    return reply[1:]
