"""Weights between jobs: each trainer process offers its own shards of a published version over
`jax.experimental.transfer`, and a generator process pulls them onto its devices. No file, no
full copy on any host, no bulk bytes through the control channel.

The layout that crosses. Every leaf, in the dtypes the generator decodes with
(`model.for_generation`: bf16 matrices for a bf16 model), is flattened, padded and seen as
`[C, chunk]` rows, C = lcm(trainer devices, generator devices). One compiled program on the
trainer lays the rows out over its devices (XLA moves the pieces; no device gathers a leaf), so
each trainer device holds one block of C / trainer-devices rows of every leaf. Those blocks are
what is offered, as they are. A generator pulls each block onto the device that holds its first
row in the generator's own row split, cuts or joins blocks on its devices into its row blocks,
and one compiled program turns the rows back into leaves in its mesh's sharding. (Pulling
straight into a different sharding is not supported by the transfer API: shapes must match.)
Where C does not split over the generator's N devices (the trainer planned another count: a
`hosts.generator_mesh` axis of -1 counts a trainer host's devices), the rows split into
g = gcd(C, N) blocks, each kept on N / g adjacent devices (g = 1: every device holds every
row, as one device does); each process of a group still pulls only the blocks its devices
hold.

A failure that repeats however often it is retried (leaves of other shapes or dtypes than this
job's model: trainer and generators run different configs) raises `PermanentFailure`, which
ends the run, naming the key, rather than being waited out as a trainer restarting would be.

Offers are made on request, because an offer holds its arrays until they are pulled: the
generator asks every trainer process's weight socket (ZeroMQ REQ/REP, JSON) for version v; the
process offers v's blocks under a fresh id and answers with the id and the manifest (its
blocks' rows, the leaves' shapes and dtypes). Once the blocks have arrived the generator says
so (`pulled`). An offer not acknowledged within `timeout` (its puller died between asking and
pulling) is withdrawn: the transfer API has no call for it, so the process pulls the offer
itself, onto the devices that hold it, and drops what arrives; the blocks are freed (else a
dead puller would keep its version's blocks alive on the trainer for the rest of the run). A
trainer process keeps the newest `keep` versions (2: the one a fixed schedule still decodes
with and the newest).

A puller frozen in the middle of a pull (SIGSTOP, a host that hangs without closing its
connections) holds up every pull of that transfer server until it resumes or dies, and the
trainer cannot cut the transfer. So while an offer waits longer than `probe_after`, the
process probes its own transfer server (a tiny offer it pulls itself); a probe that has not
arrived after `probe_wait` starts a new transfer server, which every later offer names (offers
carry their server's address). The old server is kept, with what it has in flight; a
generator whose pull from a trainer process made no progress for a few seconds asks which
server that process offers through now and, if it changed, pulls those blocks again from the
new one (telling the process to drop the old offer).
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import zmq
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.models.config import ModelConfig
from jaxrl_scale.models.policy import for_generation
from jaxrl_scale.parallel.rows import AXIS, from_rows, layout_program


class PermanentFailure(ConfigError):
    """A failure that would repeat on every try (a layout, a shape, a config that differs
    between trainer and generators): it ends the run, its message naming the key, where a
    fault (a trainer restarting, a transfer cut off) is waited out. Generator groups report
    it to the hub, which fails the trainer's wait with it (hosts/hub.py)."""


def start_server(host: str):
    """A transfer server of this process's devices, listening on `host` (an ephemeral port)."""
    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])


class WeightServer:
    """A trainer process's side. `publish` is called by the trainer's main thread (every
    process, in the same order: its layout program spans the trainer's devices); the serving
    thread answers requests. The versions held are shared by both, behind `_cond`."""

    def __init__(self, mesh: Mesh, model: ModelConfig, gen_devices: int, *, host: str,
                 keep: int = 2, timeout: float = 300.0, probe_after: float = 10.0,
                 probe_wait: float = 10.0):  # fmt: skip
        self.rows = math.lcm(mesh.devices.size, gen_devices)
        self.keep, self.timeout = keep, timeout
        self.probe_after, self.probe_wait = probe_after, probe_wait
        self.host = host
        self._layout = layout_program(
            mesh, self.rows, lambda p: for_generation(p, model, copy=False)
        )
        self._held: dict[int, list[jax.Array]] = {}
        self._sizes: list[int] = []  # each leaf's element count (set by the first publish)
        self._cond = threading.Condition()
        self._ids = itertools.count(secrets.randbits(40) << 16)
        self.transfer = start_server(host)
        self._context = zmq.Context.instance()
        socket = self._context.socket(zmq.REP)  # owned by the serving thread after this
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port(f"tcp://{host}")
        self.address = {"weights": f"tcp://{host}:{port}", "transfer": self.transfer.address(),
                        "rows": self.rows}  # fmt: skip
        self._stopping = threading.Event()
        # Written by the serving thread only (after this): the transfer server offers are
        # made on (`self.address` names the first); bytes offered; offers not yet
        # acknowledged (uuid -> (deadline, version, what a pull of them takes, the server's
        # address)); offers withdrawn, and the arrays of withdrawals still arriving; the
        # probe in flight (its deadline and arrays), when the last was made, and how often a
        # probe that did not arrive replaced the transfer server.
        self.offered_bytes = 0
        self._offers: dict[int, tuple[float, int, list, str]] = {}
        self.withdrawn = 0
        self._withdrawing: list = []
        self._own: dict[str, object] = {}  # connections to this process's transfer servers
        self._probe: tuple[float, list] | None = None
        self._probed = 0.0
        self.replaced = 0
        self._retired: list = []  # servers replaced (kept: a dropped server takes no connection)
        self._thread = threading.Thread(
            target=self._serve, args=(socket,), name="weight-server", daemon=True
        )
        self._thread.start()

    def publish(self, version: int, params) -> None:
        """Lay out `params` (the trainer's, about to be donated: the layout is a new buffer)
        as version `version`; drop versions beyond the newest `keep`."""
        rows = self._layout(params)
        self._sizes = [int(x.size) for x in jax.tree.leaves(params)]
        with self._cond:
            self._held[version] = rows
            for old in sorted(self._held)[: -self.keep]:
                del self._held[old]
            self._cond.notify_all()

    def newest(self) -> int | None:
        with self._cond:
            return max(self._held, default=None)

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _serve(self, socket) -> None:
        try:
            while not self._stopping.is_set():
                if not socket.poll(100):
                    self._tend()
                    continue
                try:
                    request = json.loads(socket.recv())
                    if "pulled" in request:  # those blocks have arrived: nothing to withdraw
                        self._offers.pop(int(request["pulled"]), None)
                        reply = {"ok": True}
                    elif "dropped" in request:  # pulled again from a new server: the pull of
                        self._offers.pop(int(request["dropped"]), None)  # it ends on the old
                        reply = {"ok": True}
                    elif "server" in request:  # which transfer server offers go through
                        reply = {"transfer": self.transfer.address()}
                    else:
                        reply = self._offer(int(request["version"]), request.get("of"))
                except (ValueError, KeyError, TypeError) as e:
                    reply = {"error": f"bad request: {e}"}
                socket.send(json.dumps(reply).encode())
                self._tend()
        finally:
            socket.close()

    def _tend(self) -> None:
        """Between requests: withdraw the offers past their deadline, probe the transfer
        server while an offer waits. A failure is logged and the thread goes on serving."""
        try:
            self._withdraw_stale()
            self._check_transfer()
        except Exception as e:  # (the transfer API's errors are RuntimeErrors of its own)
            print(f"weights: tending the offers failed ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _connection(self, address: str):
        """A connection to this process's own transfer server at `address`."""
        if address not in self._own:
            self._own[address] = self.transfer.connect(address)
        return self._own[address]

    def _withdraw_stale(self) -> None:
        """Pull, here, every offer not acknowledged by its deadline, and let it go."""
        self._withdrawing = [a for a in self._withdrawing if not a.is_ready()]
        now = time.monotonic()
        for uuid in [u for u, (deadline, *_) in self._offers.items() if deadline < now]:
            _, version, specs, server = self._offers.pop(uuid)
            self._withdrawing += self._connection(server).pull(uuid, specs)
            self.withdrawn += 1
            print(f"weights: version {version}'s offer {uuid} was not pulled in "
                  f"{self.timeout:.0f} s (its generator died?); withdrawn",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _check_transfer(self) -> None:
        """While an offer has waited `probe_after` s, pull a tiny offer of this process's
        own every `probe_after` s; one not arrived after `probe_wait` s means a puller frozen
        mid-pull holds the server up: later offers go through a new one."""
        now = time.monotonic()
        if self._probe is not None:
            deadline, arrays = self._probe
            if all(a.is_ready() for a in arrays):
                self._probe = None
            elif now > deadline:
                self._probe = None
                self._retired.append(self.transfer)
                stuck = self.transfer.address()
                self.transfer = start_server(self.host)
                self.replaced += 1
                print(f"weights: the transfer server {stuck} delivered nothing to this process "
                      f"in {self.probe_wait:.0f} s (a puller frozen mid-pull holds up all its "
                      f"pulls: a hung host?); later offers go through a new one, "
                      f"{self.transfer.address()}", file=sys.stderr, flush=True)  # fmt: skip
            return
        if now - self._probed < self.probe_after:
            return
        offered = [deadline - self.timeout for deadline, *_ in self._offers.values()]
        if not offered or now - min(offered) < self.probe_after:
            return
        self._probed = now
        probe = jax.device_put(np.zeros(8, np.float32), jax.local_devices()[0])
        uuid = next(self._ids)
        self.transfer.await_pull(uuid, [probe])
        spec = jax.ShapeDtypeStruct(probe.shape, probe.dtype, sharding=probe.sharding)
        arrays = self._connection(self.transfer.address()).pull(uuid, [spec])
        self._probe = (now + self.probe_wait, arrays)

    def _offer(self, version: int, of: list | None = None) -> dict:
        """Offer this process's blocks of `version`: all of them, or with `of` = [first,
        stop, devices] those holding rows of a puller's devices first..stop-1 out of
        `devices` (a generator group of several processes: each pulls its own devices' rows)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while max(self._held, default=-1) < version and time.monotonic() < deadline:
                self._cond.wait(timeout=0.1)
                if self._stopping.is_set():
                    break
            rows = self._held.get(version)
            held = sorted(self._held)
        if rows is None:
            return {"error": f"version {version} is not held here", "held": held}
        shards = [sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0) for x in rows]
        blocks = [[s.index[0].start or 0, s.index[0].stop or self.rows] for s in shards[0]]
        if of is not None:  # only the blocks holding rows lo..hi-1
            first, stop, devices = (int(x) for x in of)
            lo, hi = first * self.rows // devices, stop * self.rows // devices
            keep = [i for i, (a, b) in enumerate(blocks) if a < hi and b > lo]
            shards = [[leaf[i] for i in keep] for leaf in shards]
            blocks = [blocks[i] for i in keep]
        if not blocks:
            return {"error": f"no rows of version {version} here for {of}", "held": held}
        arrays = [s.data for leaf in shards for s in leaf]
        uuid = next(self._ids)
        self.transfer.await_pull(uuid, arrays)
        self.offered_bytes += sum(a.nbytes for a in arrays)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(a.device))
                 for a in arrays]  # fmt: skip
        server = self.transfer.address()
        self._offers[uuid] = (time.monotonic() + self.timeout, version, specs, server)
        return {
            "uuid": uuid,
            "version": version,
            "rows": self.rows,
            "chunks": [int(x.shape[1]) for x in rows],
            "sizes": self._sizes,
            "dtypes": [str(x.dtype) for x in rows],
            "blocks": blocks,
            "transfer": server,
        }


class WeightClient:
    """A generator process's side: pulls a version from every trainer process and rebuilds the
    parameters in `shardings` (the generator mesh's). One owner thread (its sockets)."""

    recheck = 5.0  # seconds between asking, while a pull has not arrived, if it moved

    def __init__(self, abstract, shardings, mesh: Mesh, *, host: str, timeout: float):
        self.treedef = jax.tree.structure(abstract)
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(abstract)]
        self.dtypes = [str(x.dtype) for x in jax.tree.leaves(abstract)]
        self.devices = list(mesh.devices.flat)
        # This process's devices in the group's flat order: one run of them (a group of
        # several processes pulls each process's rows apart).
        mine = [i for i, d in enumerate(self.devices) if d.process_index == jax.process_index()]
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError(f"this process's devices are not adjacent in the group's mesh: "
                             f"{mine} of {len(self.devices)}")  # fmt: skip
        self.mine = (mine[0], mine[-1] + 1)
        self.timeout = timeout
        self._split: tuple[int, NamedSharding] | None = None  # (rows, their sharding here)
        shapes = self.shapes
        self._unlayout = jax.jit(
            lambda rows: [from_rows(r, s) for r, s in zip(rows, shapes, strict=True)],
            out_shardings=jax.tree.leaves(shardings),
        )
        self.transfer = start_server(host)
        self._context = zmq.Context.instance()
        self._trainers: list[dict] = []
        self._sockets: list[zmq.Socket] = []
        self._connections: dict[str, object] = {}
        # The last pull, per trainer process: its offer's id, the transfer server it was made
        # on, and the blocks pulled ({leaf: [(first row, block)]}).
        self._pulled: list[int] = []
        self._servers: list[str] = []
        self._got: list[dict[int, list[tuple[int, jax.Array]]]] = []
        self.pulled_bytes = 0
        self.pulls = 0  # versions pulled (`pulled_bytes` / `pulls` / `version_bytes`: the
        # share of a version this process pulls: 1, or its devices' share of a group's)
        self.version_bytes = sum(
            math.prod(s) * np.dtype(d).itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    def connect(self, trainers: list[dict]) -> None:
        """Trainer processes' addresses ({"weights", "transfer", "rows"}), from the hub."""
        self._rows_split(int(trainers[0]["rows"]))
        for s in self._sockets:
            s.close(linger=0)
        self._trainers, self._sockets = list(trainers), []
        for t in trainers:
            s = self._context.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.REQ_RELAXED, 1)
            s.setsockopt(zmq.REQ_CORRELATE, 1)
            s.connect(t["weights"])
            self._sockets.append(s)
        self._connections = {}

    def pull(self, version: int):
        """Version `version`'s parameters on this generator's devices, or raise
        `TimeoutError` / `LookupError` naming the trainer process that did not give them."""
        rows = self.arrived(self.pull_rows(version), version, self.timeout)
        self.acknowledge()
        return self.lay_out(rows)

    def arrived(self, rows: list[jax.Array], version: int, timeout: float) -> list[jax.Array]:
        """`rows` (`pull_rows(version)`) once every block has arrived, or a TimeoutError
        after `timeout` s. A trainer process whose blocks made no progress for `recheck` s is
        asked which transfer server it offers through; if another (it replaced one that a
        frozen puller held up: module docstring), its blocks are pulled again from there."""
        deadline = time.monotonic() + timeout
        check = time.monotonic() + self.recheck
        seen = self._progress()
        while not all(x.is_ready() for x in rows):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"version {version}'s blocks had not arrived after "
                                   f"{timeout:.0f} s")  # fmt: skip
            if now > check:
                check = now + self.recheck
                progress = self._progress()
                stalled = [i for i, (before, after) in enumerate(zip(seen, progress, strict=True))
                           if after == before < self._count(i)]  # fmt: skip
                seen = progress
                moved = [i for i in stalled if self._moved(i)]
                for i in moved:
                    print(f"weights: trainer process {self._trainers[i]['weights']} offers "
                          f"through a new transfer server; pulling its blocks of version "
                          f"{version} again", file=sys.stderr, flush=True)  # fmt: skip
                    self._tell(i, {"dropped": self._pulled[i]})
                    self._pulled[i], self._servers[i], self._got[i] = self._pull_from(i, version)
                if moved:
                    rows, seen = self._assembled(), self._progress()
            time.sleep(0.01)
        return jax.block_until_ready(rows)

    def _progress(self) -> list[int]:
        """Blocks arrived so far from each trainer process."""
        return [sum(b.is_ready() for blocks in got.values() for _, b in blocks)
                for got in self._got]  # fmt: skip

    def _count(self, i: int) -> int:
        return sum(len(blocks) for blocks in self._got[i].values())

    def _moved(self, i: int) -> bool:
        """Whether trainer process i offers through another transfer server than the one
        its offer of the last pull named."""
        reply = self._tell(i, {"server": True})
        return reply is not None and "transfer" in reply and reply["transfer"] != self._servers[i]

    def _tell(self, i: int, request: dict) -> dict | None:
        """Trainer process i's answer to `request`, or None after 10 s (its socket takes
        the next request all the same)."""
        socket = self._sockets[i]
        socket.send(json.dumps(request).encode())
        if socket.poll(int(min(self.timeout, 10.0) * 1000)):
            return json.loads(socket.recv())
        return None

    def acknowledge(self) -> None:
        """Tell each trainer process that the last pull's blocks have arrived (call once they
        have), so it does not withdraw the offer; a process that does not answer within 10 s
        is left to withdraw it (its socket takes the next request all the same)."""
        for i, uuid in enumerate(self._pulled):
            self._tell(i, {"pulled": uuid})
        self._pulled = []

    def lay_out(self, rows):
        """Pulled rows (`pull_rows`) in the parameters' own layout: a program over every
        device of the generator. Run it on the thread that decodes: two threads' programs
        with collectives on the same CPU devices can wait for each other forever (each
        device joins one program's all-gather while another device joins the other's)."""
        return jax.tree.unflatten(self.treedef, self._unlayout(rows))

    def pull_rows(self, version: int) -> list[jax.Array]:
        """Version `version`'s leaves as [rows, chunk] blocks split over the devices, moved
        with no program that spans devices (safe beside a decoding thread)."""
        self._pulled, self._servers, self._got = [], [], []
        self.pulls += 1
        for i in range(len(self._trainers)):
            uuid, server, got = self._pull_from(i, version)
            self._pulled.append(uuid)
            self._servers.append(server)
            self._got.append(got)
        return self._assembled()

    def _pull_from(self, i: int, version: int) -> tuple[int, str, dict]:
        """Ask trainer process i for its blocks of `version` and start pulling them: the
        offer's id, its transfer server, and the blocks ({leaf: [(first row, block)]})."""
        t = self._trainers[i]
        socket = self._sockets[i]
        socket.send(json.dumps(self._ask(version)).encode())
        if not socket.poll(int(self.timeout * 1000)):
            raise TimeoutError(
                f"trainer weight server {t['weights']}: no answer in {self.timeout:.0f} s "
                f"to a request for version {version}"
            )
        offer = json.loads(socket.recv())
        if "error" in offer:
            raise LookupError(f"trainer weight server {t['weights']}: {offer['error']}")
        self._check(offer)
        rows = offer["rows"]
        per, copies = rows // self.blocks, len(self.devices) // self.blocks
        lo = self.mine[0] // copies * per  # a block from before this process's rows
        specs = [
            jax.ShapeDtypeStruct(
                (stop - start, chunk),
                dtype,
                sharding=SingleDeviceSharding(self._holder(max(start, lo) // per)),
            )
            for chunk, dtype in zip(offer["chunks"], offer["dtypes"], strict=True)
            for start, stop in offer["blocks"]
        ]
        connection = self._connections.get(offer["transfer"])
        if connection is None:
            connection = self.transfer.connect(offer["transfer"])
            self._connections[offer["transfer"]] = connection
        got = iter(connection.pull(offer["uuid"], specs))
        self.pulled_bytes += sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                                 for s in specs)  # fmt: skip
        pieces = {leaf: [(start, next(got)) for start, _ in offer["blocks"]]
                  for leaf in range(len(self.shapes))}  # fmt: skip
        return offer["uuid"], offer["transfer"], pieces

    def _assembled(self) -> list[jax.Array]:
        """The last pull's blocks, from every trainer process, as each leaf's rows."""
        rows = self._split[0]
        return [self._rows_array(sorted((p for got in self._got for p in got[leaf]),
                                        key=lambda p: p[0]), rows)
                for leaf in range(len(self.shapes))]  # fmt: skip

    @property
    def blocks(self) -> int:
        """Row blocks over this generator's devices (each kept on devices / blocks of them)."""
        return self._split[1].mesh.shape[AXIS]

    def _rows_split(self, rows: int) -> None:
        """The split of `rows` rows over this generator's devices: g = gcd(rows, devices)
        blocks, each on devices / g adjacent devices (all of them where rows split evenly)."""
        if self._split is not None and self._split[0] == rows:
            return
        n = len(self.devices)
        g = math.gcd(rows, n)
        if g < n:
            print(f"weights: the trainer lays versions out in {rows} rows, which do not split "
                  f"over this generator's {n} devices; each block of {rows // g} rows is kept "
                  f"on {n // g} devices (hosts.generator_mesh: give the trainer this "
                  f"generator's device count, {n}, to split them)", flush=True)  # fmt: skip
        mesh = Mesh(np.asarray(self.devices).reshape(g, n // g), (AXIS, "copies"))
        self._split = (rows, NamedSharding(mesh, PartitionSpec(AXIS)))

    def _ask(self, version: int) -> dict:
        """The request for `version`: every row, or (one process of a group's several) the
        blocks its devices hold, as [first, stop, blocks]."""
        ask = {"version": version}
        if self.mine != (0, len(self.devices)):
            copies = len(self.devices) // self.blocks
            ask["of"] = [self.mine[0] // copies, -(-self.mine[1] // copies), self.blocks]
        return ask

    def _holder(self, block: int):
        """A device of this process that holds row block `block`."""
        copies = len(self.devices) // self.blocks
        first = max(block * copies, self.mine[0])
        return self.devices[first]

    def _check(self, offer: dict) -> None:
        sizes = [math.prod(s) for s in self.shapes]
        if offer["dtypes"] != self.dtypes or offer["sizes"] != sizes:
            raise PermanentFailure(
                f"model: the trainer offers {len(offer['chunks'])} leaves of "
                f"{sum(offer['sizes'])} elements in {sorted(set(offer['dtypes']))}; this "
                f"generator's model has {len(self.shapes)} of {sum(sizes)} in "
                f"{sorted(set(self.dtypes))}: trainer and generators must run the same config "
                "(model.*, model.lora.*)"
            )
        if offer["rows"] != self._split[0]:
            raise PermanentFailure(
                f"hosts.generator_mesh: trainer processes lay versions out in "
                f"{offer['rows']} and {self._split[0]} rows: they must run the same config"
            )

    def _rows_array(self, blocks: list[tuple[int, jax.Array]], rows: int) -> jax.Array:
        """One leaf's [rows, chunk] array in this generator's row split (`_rows_split`),
        from blocks that cover this process's rows in order (each on a device holding its
        first row): each of this process's devices gets its row block, cut from or joined
        of the pulled blocks."""
        per, copies = rows // self.blocks, len(self.devices) // self.blocks
        local = []
        for device in range(*self.mine):
            lo = device // copies * per
            hi = lo + per
            parts = []
            for start, block in blocks:  # in row order
                stop = start + block.shape[0]
                if start < hi and stop > lo:
                    a, b = max(start, lo), min(stop, hi)
                    part = block if (a, b) == (start, stop) else block[a - start : b - start]
                    parts.append(jax.device_put(part, self.devices[device]))
            local.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        shape = (rows, blocks[0][1].shape[1])
        return jax.make_array_from_single_device_arrays(shape, self._split[1], local)

    def close(self) -> None:
        for s in self._sockets:
            s.close(linger=0)
