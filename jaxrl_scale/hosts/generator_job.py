"""A generator group's process (`jaxrl-scale train --role generator --group N`): no train state,
no optimizer, no curriculum. It joins the trainer's hub, asks for prompts, decodes them with the
newest weights it has pulled (on its own mesh, `hosts.generator_mesh`: the slot engine with
continuous batching, two of the hub's batches in it at once, else static waves), scores the
completions and pushes the scored batch back, until the hub says stop. SIGTERM drains it: no
new work, what it holds finished and sent, then it leaves (`Drain`).

Weights arrive in flight: a heartbeat thread tells the hub the group is alive and learns the
newest version; a puller thread pulls a newer version over `jax.experimental.transfer` while
decoding goes on with the one in use, and decoding takes it between chunks, so every token
records the version that sampled it. Under a fixed schedule (`pipeline.mode: sync`, or
`pipeline.lockstep`) the batch names the versions its chunks use, and decoding waits for
exactly those.

When the trainer goes away (killed, restarting from its checkpoint), requests go unanswered:
after `hosts.timeout` seconds of that (or of weights that do not come) the group drops what it
held and asks to join again for up to `hosts.restart_timeout` seconds, so a trainer that
restarts (load, restore, compile) finds it waiting; a new trainer answers with a new run id.
A group that reaches no trainer at all exits after `hosts.timeout`, naming the hub. A failure
that would repeat however often the group rejoined (`weights.PermanentFailure`: leaves of
another model than the trainer's; a config error at setup) is told to the hub, which ends the
trainer's run with it, naming the key, and the group exits (status 2). So is broken scoring
(`ScorerBroken`: a batch whose failed samples pass `task.max_failure_fraction`, a verifier
that cannot run; `PoolBroken`: no worker process starts): the trainer's run ends with the
scorer's error, as a colocated run's does, not after `hosts.timeout`. Threads:
the main thread owns the control and data sockets and the decoding; the puller thread owns the
`WeightClient`; the heartbeat thread its own control socket; both outlive any one trainer
(a failure is handed to the main thread, which rejoins). The versions held, the newest
announced and a failure are shared behind `Weights._cond`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
import zmq
from flax import nnx

from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.generation.sampler import Interruption, Sampling
from jaxrl_scale.hosts.hub import ROLLOUT_FIELDS, address, encode_batch, static_waves
from jaxrl_scale.hosts.weights import PermanentFailure, WeightClient
from jaxrl_scale.models import lora
from jaxrl_scale.models.policy import Policy, for_generation
from jaxrl_scale.parallel import distributed, sharding
from jaxrl_scale.rl.agents import EngineAgents
from jaxrl_scale.rl.episodes import EngineEpisodes, EpisodeRunner
from jaxrl_scale.rl.generator import EngineBatches, WaveGenerator
from jaxrl_scale.rl.rollout import (
    agent_of,
    check_agent_run,
    held_out_scores,
    score_episodes,
    score_rollout,
)
from jaxrl_scale.tasks import make_scorer, make_task
from jaxrl_scale.tasks.env import EnvRunner
from jaxrl_scale.tasks.scoring import ScorerBroken
from jaxrl_scale.tasks.workers import PoolBroken

if TYPE_CHECKING:  # the root config composes every part's section
    from jaxrl_scale.config import ExperimentConfig


# Fault drills only (benchmarks/bench_soak.py): seconds each weight pull is held open after
# the trainer processes offered their blocks, so a drill can kill a group during a pull.
PULL_DELAY = float(os.environ.get("JAXRL_PULL_DELAY", "0"))


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Pulled parameters not yet laid out (`WeightClient.pull_rows`)."""

    leaves: list


class Rejoin(Exception):
    """The trainer this process worked for is gone (a new run answers): start over."""


class Stopped(Exception):
    """The trainer said stop (its run is over) while this group was generating a batch."""


class TrainerLost(Exception):
    """The trainer could not be reached (silent for `hosts.timeout`, or weights that did not
    come): rejoin, waiting for it to come back (`hosts.restart_timeout`)."""


_RAISED = {"Rejoin": Rejoin, "Stopped": Stopped, "TrainerLost": TrainerLost,
           "PermanentFailure": PermanentFailure}  # fmt: skip


class Group:
    """The processes of one generator group: one `jax.distributed` job of its own (the group's
    coordinator, JAXRL_COORDINATOR etc. in its processes' environment), its mesh over all
    their devices. Process 0, the leader, talks to the hub, pulls its rows, decides and
    sends; the others pull their own rows and follow: everything the leader's loop branches
    on (the hub's answers, the version each chunk decodes with, a stop, a failure, a drain)
    is `share`d in the group's key-value store in order, so every process issues the same
    programs in the same order. One process: nothing is shared. One owner thread (the
    decoding one)."""

    def __init__(self):
        self.size, self.leader = jax.process_count(), jax.process_index() == 0
        self.seq = 0

    def share(self, value):
        """The leader's `value` on every process (the others' argument is ignored)."""
        if self.size == 1:
            return value
        key = f"jaxrl_scale/group/{self.seq}"
        self.seq += 1
        if self.leader:
            distributed.announce(key, json.dumps(value))
            if self.seq > _KEPT:  # long read: the followers run the same programs in step
                distributed.forget(f"jaxrl_scale/group/{self.seq - _KEPT - 1}")
            return value
        while True:  # the leader bounds every wait; a leader that dies ends the job
            try:
                return json.loads(distributed.wait_for(key, 600, "the group leader's step"))
            except TimeoutError:
                continue


# Shared steps a group's key-value store keeps (older ones are deleted), and the keys of the
# versions the leader pulls (the followers pull them at the same time).
_KEPT = 4096
_PULLS = "jaxrl_scale/group/pull/"
_HELD = "jaxrl_scale/group/held/"  # + process: the versions a follower holds
_BROKEN = "jaxrl_scale/group/broken"  # a follower's permanent failure (for the leader)


class Requester:
    """Request/reply to the hub over ZeroMQ with a per-try timeout, retried until `patience`
    seconds have passed (then TimeoutError naming the hub and the request). One owner thread."""

    def __init__(self, hub: str, *, patience: float, what: str):
        self.hub, self.patience, self.what = hub, patience, what
        self.socket = zmq.Context.instance().socket(zmq.REQ)
        for option in (zmq.REQ_RELAXED, zmq.REQ_CORRELATE):
            self.socket.setsockopt(option, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{hub}")

    def request(self, message: dict, patience: float | None = None, stopped=None) -> dict:
        """The hub's answer; `stopped()` true between tries ends the wait as {"stop": True}
        (the hub said stop on another socket and closes once every group was told)."""
        deadline = time.monotonic() + (self.patience if patience is None else patience)
        while True:
            self.socket.send(json.dumps(message).encode())
            if self.socket.poll(2000):
                return json.loads(self.socket.recv())
            if stopped is not None and stopped():
                return {"stop": True}
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.what}: no answer from the trainer's hub at {self.hub} for "
                    f"{self.patience:.0f} s (asked: {message.get('op')})"
                )

    def close(self) -> None:
        self.socket.close(linger=0)


class Weights:
    """The versions this generator holds: pulled by the puller thread, read by decoding."""

    def __init__(self, client: WeightClient, hub: str, *, timeout: float, group: int,
                 processes: Group | None = None):  # fmt: skip
        self.client, self.hub, self.timeout, self.group = client, hub, timeout, group
        # A group of several processes: the leader's choices are shared (`get`); the
        # followers beat nothing (the leader speaks for the group).
        self.processes = processes or Group()
        self._cond = threading.Condition()
        self._held: dict[int, object] = {}
        self._using: int | None = None
        self._want: int | None = None  # an exact version (fixed schedule), else the newest
        self._session: dict | None = None  # {"run", "gen", "weights"} of the current join
        self._gone = False
        self._stopped = False  # the hub answered a heartbeat with stop: the run is over
        self._failed: BaseException | None = None
        self._newest: int | None = None  # the newest version the hub announced
        self._progress = 0  # decode chunks started: the heartbeat tells the hub (a hang shows)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._pull, name="weight-puller", daemon=True)]
        if self.processes.leader:
            self._threads.append(threading.Thread(target=self._beat, name="heartbeat",
                                                  daemon=True))  # fmt: skip
        for thread in self._threads:
            thread.start()

    def attach(self, session: dict) -> None:
        """A new join: what was held, and a failure recorded, belong to the trainer before it
        (the heartbeat and puller threads go on: they outlive any one trainer)."""
        with self._cond:
            self._session, self._held, self._using, self._gone = session, {}, None, False
            self._failed = None
            self._newest = session["version"]
            self._want = None  # an exact version asked of the trainer before is not this one's
            self._tell_held()
            self._cond.notify_all()

    def get(self, *, version: int | None = None, at_least: int = -1):
        """(version, params) to decode the next chunk with: exactly `version`, else the newest
        held and at least `at_least` (waiting for the puller, at most `timeout` seconds). In
        a group of several processes the leader's answer (or failure) is every process's:
        the others take exactly the version it took."""
        group = self.processes
        if group.size > 1 and not group.leader:
            told = group.share(None)
            if "raise" in told:
                raise _RAISED[told["raise"]](told["message"])
            with self._cond:
                self._newest = told["newest"]
            try:
                have = self._get(version=told["version"])
                return have, self._laid(have)
            except PermanentFailure as e:  # the leader reads it and tells the hub
                distributed.publish(_BROKEN, str(e))
                raise SystemExit(f"generator group {self.group} process "
                                 f"{jax.process_index()}: {e}") from e  # fmt: skip
            except (Stopped, Rejoin, TrainerLost) as e:  # the leader has it; this one not
                raise SystemExit(f"generator group {self.group} process "
                                 f"{jax.process_index()}: {e}") from e  # fmt: skip
        try:
            # Laid out after the others are told: laying it out is a program over every
            # process's devices, which a follower joins only once it knows the version.
            have = self._get(version=version, at_least=at_least)
        except (Stopped, Rejoin, TrainerLost, PermanentFailure) as e:
            group.share({"raise": type(e).__name__, "message": str(e)})
            raise
        with self._cond:
            newest = self._newest
        group.share({"version": have, "newest": newest})
        return have, self._laid(have)

    def _get(self, *, version: int | None = None, at_least: int = -1) -> int:
        """The version to decode with (held here, and in use from now on; `_laid` gives
        its parameters)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._want = version
            self._progress += 1
            self._cond.notify_all()
            while True:
                if self._stopped:
                    raise Stopped
                if self._gone:
                    raise Rejoin
                if isinstance(self._failed, PermanentFailure):  # rejoining would not help
                    raise self._failed
                broken = distributed.peek(_BROKEN) if self.processes.size > 1 else None
                if broken:  # a follower's: every process of the group meets it
                    raise PermanentFailure(broken)
                if self._failed is not None:  # the trainer went quiet, or a pull failed
                    raise TrainerLost(str(self._failed)) from self._failed
                have = version if version in self._held else max(self._everyones(), default=-1)
                if have == version or (version is None and have >= 0 and have >= at_least):
                    break
                if time.monotonic() > deadline:
                    raise TrainerLost(
                        f"generator group {self.group}: no weights of version "
                        f"{version if version is not None else f'>= {at_least}'} from the "
                        f"trainer (hub {self.hub}) in {self.timeout:.0f} s"
                    )
                self._cond.wait(timeout=0.1)
            self._using = have
            for old in [v for v in self._held if v < have]:
                del self._held[old]  # no chunk decodes with it any more
            self._tell_held()
        return have

    def _laid(self, have: int):
        """Version `have` (held, in use) in the parameters' layout: laid out here, on the
        decoding thread, the first time it is asked for."""
        with self._cond:
            held = self._held[have]
        if isinstance(held, _Rows):
            held = self.client.lay_out(held.leaves)
            with self._cond:
                self._held[have] = held
        return held

    def _everyones(self) -> set[int]:
        """The versions held here and, in a group of several processes, by every follower
        (the leader decodes with one they all hold: a follower that would pull it only once
        told could find the trainer no longer keeps it)."""
        held = set(self._held)
        for process in range(1, self.processes.size):
            theirs = distributed.peek(f"{_HELD}{process}")
            held &= set(json.loads(theirs)) if theirs else set()
        return held

    def _tell_held(self) -> None:
        """A follower: publish the versions it holds (for the leader's `_everyones`)."""
        if self.processes.size > 1 and not self.processes.leader:
            distributed.publish(f"{_HELD}{jax.process_index()}", json.dumps(sorted(self._held)))

    @property
    def stopped(self) -> bool:
        """The hub answered a heartbeat with stop: the trainer's run is over."""
        with self._cond:
            return self._stopped

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _beat(self) -> None:
        """The heartbeat: tells the hub this group is alive (also while a pull or a long
        decode runs) and learns the newest version published. A beat the trainer leaves
        unanswered for `timeout` is handed to the decoding thread (which rejoins) and the
        beats go on, for the trainer that comes back."""
        beat = Requester(self.hub, patience=self.timeout, what=f"generator group {self.group}")
        try:
            while not self._stop.wait(0.25):
                with self._cond:
                    session, progress = self._session, self._progress
                if session is None:
                    continue
                try:
                    reply = beat.request({"op": "beat", "run": session["run"],
                                          "gen": session["gen"], "progress": progress})  # fmt: skip
                except Exception as e:  # surfaced to the decoding thread
                    self._fail(e, session)
                    continue
                with self._cond:
                    if self._session is session:
                        self._gone = self._gone or "rejoin" in reply
                        self._stopped = self._stopped or bool(reply.get("stop"))
                        self._newest = reply.get("version", self._newest)
                        self._cond.notify_all()
                if reply.get("stop"):  # a batch waiting for weights that will never come
                    return
        finally:
            beat.close()

    def _pull(self) -> None:
        """Pulls the version decoding wants (exact, or the newest published) while decoding
        goes on with the one it has. A pull that fails is handed to the decoding thread
        (which rejoins) and this thread goes on, for the next session."""
        session = broken = None  # broken: the session a pull failed in
        group, pulls = self.processes, 0  # pulls: the leader's pulls announced (or taken)
        follower = group.size > 1 and not group.leader
        while not self._stop.is_set():
            told = None  # a follower pulls each version as the leader starts pulling it
            if follower:
                with self._cond:  # a version decoding waits for comes first
                    need = self._want if self._want not in (None, *self._held) else None
                while need is None:  # else the newest the leader has announced (a follower
                    try:  # behind skips versions, as the leader does)
                        wait = 0.1 if told is None else 0.001
                        told = int(distributed.wait_for(f"{_PULLS}{pulls}", wait, "a pull"))
                        pulls += 1
                    except TimeoutError:
                        break
                told = need if need is not None else told
            with self._cond:
                if told is None:
                    self._cond.wait(timeout=0.1)
                if self._session is not session:
                    session = self._session
                    self.client.connect(session["weights"])
                want = self._want if self._want is not None else self._newest
                if follower:  # what the leader pulls; else a version it decodes with
                    want = told if told is not None else self._want
                if session is None or session is broken or want is None or want in self._held:
                    continue
                if want > self._newest and not follower:
                    continue
            if group.size > 1 and group.leader:  # the followers pull it too, now
                distributed.announce(f"{_PULLS}{pulls}", str(want))
                if pulls >= _KEPT:
                    distributed.forget(f"{_PULLS}{pulls - _KEPT}")
                pulls += 1
            try:  # laid out by the decoding thread when it takes them (`get`)
                rows = self.client.pull_rows(want)
                if PULL_DELAY:  # a fault drill: the pull is held open (offered, in flight)
                    print(f"weights: pulling version {want}", flush=True)
                    time.sleep(PULL_DELAY)
                params = _Rows(self._arrived(rows, want))
                self.client.acknowledge()  # (else the trainer withdraws the offer in time)
            except LookupError:  # superseded meanwhile: ask for the newest next
                time.sleep(0.05)
                continue
            except PermanentFailure as e:  # every pull would fail so: no rejoin
                print(f"weights: pulling version {want} failed ({e})", file=sys.stderr,
                      flush=True)  # fmt: skip
                broken = session
                self._fail(e, session)
                continue
            except Exception as e:  # the trainer died mid-pull, or went quiet
                print(f"weights: pulling version {want} failed ({e}); pulling again once "
                      "this group has rejoined", file=sys.stderr, flush=True)  # fmt: skip
                broken = session
                self._fail(e, session)
                continue
            with self._cond:
                if self._session is session:
                    self._held[want] = params
                    keep = {want, self._using}
                    for v in [v for v in self._held if v not in keep]:
                        if follower and v > (self._using or -1):
                            continue  # the leader may choose it (`_everyones`): kept
                        del self._held[v]
                    self._tell_held()
                    self._cond.notify_all()

    def _arrived(self, rows, version: int):
        """`rows` once every block has arrived, before decoding may use them (a transfer cut
        off, the trainer dying mid-pull, fails here rather than in a decode step later); a
        TimeoutError naming the trainer after `timeout` seconds."""
        try:
            return self.client.arrived(rows, version, self.timeout)
        except TimeoutError as e:
            raise TimeoutError(
                f"generator group {self.group}: version {version}'s weights had not "
                f"arrived from the trainer (hub {self.hub}): {e}"
            ) from e

    def _fail(self, e: BaseException, session: dict | None) -> None:
        with self._cond:
            if self._session is session:  # (a failure of a session before is not this one's)
                self._failed = e
                self._cond.notify_all()


def _model(cfg: ExperimentConfig):
    """(model config, graphdef, abstract generation params, tokenizer or None): from the
    config, or from the Hugging Face folder it starts from (config and tokenizer only). The
    parameters are what the trainer sends: every one, or with LoRA the adapters alone."""
    m, tokenizer = cfg.model, None
    if m.lora.init_from:
        from jaxrl_scale.models.peft import resolve_lora

        m = dataclasses.replace(m, lora=resolve_lora(m.lora))
    if m.init_from:
        from jaxrl_scale.models.hf import config_from_hf, load_tokenizer, resolve_checkpoint

        folder = resolve_checkpoint(m.init_from)
        hf = json.loads((folder / "config.json").read_text())
        m = config_from_hf(hf, **m.runtime_fields())
        tokenizer = load_tokenizer(folder)
    abstract = nnx.eval_shape(lambda: Policy(m, rngs=nnx.Rngs(params=0)))
    graphdef, _, params = lora.split_policy(abstract, m)
    gen = jax.eval_shape(lambda p: for_generation(p, m, copy=False), params)
    return m, graphdef, gen, tokenizer


def _generation_base(cfg: ExperimentConfig, m, mesh):
    """A LoRA run's base as this job decodes with it (None without LoRA): the job's own copy,
    made as the trainer makes it (model.init_from, else the seed's initialisation), so the
    trainer sends only adapters."""
    if not m.lora.enabled:
        return None
    if m.init_from:
        from jaxrl_scale.models.hf import load_pretrained

        model, _ = load_pretrained(m.init_from, mesh=mesh, seed=cfg.seed, **m.runtime_fields())
    else:
        model = sharding.init_sharded(lambda rngs: Policy(m, rngs=rngs), mesh, cfg.seed)
    _, frozen, _ = lora.split_policy(model, m)
    return for_generation(frozen, m, copy=False)


def run_generator(cfg: ExperimentConfig, group: int) -> int:
    """Serve the trainer as generator group `group` until it says stop; the exit status. A
    group of several processes (JAXRL_COORDINATOR, JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID:
    a `jax.distributed` job of its own) runs this on each of them (`Group`)."""
    # A group of several processes: a job of its own, named by the group's environment
    # (JAXRL_COORDINATOR ...), not by the config's `distributed` (the trainer's job), nor a
    # cluster's detected one (groups started by one scheduler step are separate jobs).
    if os.environ.get("JAXRL_COORDINATOR"):
        own = dataclasses.replace(cfg.distributed, coordinator_address=None,
                                  num_processes=None, process_id=None)  # fmt: skip
        distributed.initialize(own)
    processes = Group()
    lead = processes.leader
    name = f"generator group {group} ({socket.gethostname()})"
    if not lead:
        name += f" process {jax.process_index()}"
    drain = Drain(name)  # (before the model is built: a drain while it is, is one too)
    host = address(cfg, trainer=False)
    mesh = sharding.make_mesh(cfg.hosts.generator_mesh, jax.devices())
    model_cfg, graphdef, abstract, tokenizer = _model(cfg)
    base = _generation_base(cfg, model_cfg, mesh)
    task = make_task(cfg.task, seed=cfg.seed, tokenizer=tokenizer)
    scorer = make_scorer(cfg.task, task)  # the verifier's workers, as the trainer's
    tok = task.tokenizer
    agent = agent_of(cfg, task)
    if agent is not None:
        check_agent_run(cfg, tok, hasattr(task, "make_env"))
    if hasattr(task, "make_env") or agent is not None:  # the episode budget bounds contexts
        if processes.size > 1 and agent is None:
            raise ConfigError(
                "hosts: a generator group of several processes runs single-turn and agent "
                "tasks (a multi-turn task's environments answer one process)"
            )
        longest = cfg.task.max_episode_tokens
    else:
        examples = task.train_examples + task.eval_examples
        longest = max(len(tok.encode(e["prompt"])) for e in examples)
    waves = WaveGenerator(cfg, graphdef, tok, Interruption.from_config(cfg.sampler, tok),
                          mesh=mesh, own_devices=True, longest_prompt=longest)  # fmt: skip
    episodes = None
    if hasattr(task, "make_env"):  # its environments live here, on the generator's host
        envs = EnvRunner(workers=cfg.task.env_workers, timeout=cfg.task.env_timeout)
        episodes = EpisodeRunner(cfg, task, tok, waves.generate, envs)
    client = WeightClient(abstract, sharding.state_shardings(abstract, mesh), mesh, host=host,
                          timeout=cfg.hosts.timeout)  # fmt: skip
    control = data = None
    if lead:  # the hub hears from the leader alone
        control = Requester(cfg.hosts.hub, patience=cfg.hosts.timeout, what=name)
        data = zmq.Context.instance().socket(zmq.PUSH)
        data.setsockopt(zmq.LINGER, 2000)
        hub_host, port = cfg.hosts.hub.rsplit(":", 1)
        data.connect(f"tcp://{hub_host}:{int(port) + 1}")
    weights = Weights(client, cfg.hosts.hub, timeout=cfg.hosts.timeout, group=group,
                      processes=processes)  # fmt: skip
    s = cfg.sampler
    sampling = Sampling(s.temperature, s.top_p, s.top_k)
    run_key = jax.random.key(cfg.seed)
    made = seq = 0
    patience = cfg.hosts.timeout  # to reach a trainer at all; then for it to come back
    on_engine = cfg.batching == "continuous"  # (a fixed schedule's batches: static waves)
    batch_rows = cfg.train.prompts_per_step * cfg.train.group_size
    say = (lambda text: print(text, flush=True)) if lead else (lambda text: None)
    why = static_waves(cfg)
    if why is not None:
        say(f"{name}: {why}")

    def ask(message: dict, **kwargs) -> dict:
        """The hub's answer to the leader's `message`, on every process of the group."""
        reply = None
        if lead:
            try:
                reply = control.request(message, **kwargs)
            except TimeoutError as e:
                reply = {"timeout": str(e)}
        reply = processes.share(reply)
        if "timeout" in reply:
            raise TimeoutError(reply["timeout"])
        return reply

    def push(frames: list[bytes] | None, session: dict, sent: dict[str, list]) -> None:
        if not lead:  # the followers decoded the same rows; the leader sends them
            return
        header = json.loads(frames[0])
        header.update(run=session["run"], gen=session["gen"])
        frames[0] = json.dumps(header).encode()
        data.send_multipart(frames)
        if "eval" in header:
            sent["sent_evals"].append([header["eval"], header["part"]])
        else:
            sent["sent"].append(header["batch"])

    engine = None
    try:
        while True:
            if processes.share(drain.asked):  # before it joined: nothing held, nothing to tell
                say(f"{name}: drained before it joined")
                return 0
            token = secrets.token_hex(8)  # a retried join is the same join
            join = {"op": "join", "group": group, "host": host, "token": token,
                    "processes": processes.size}  # fmt: skip
            session = ask(join, patience=patience)
            patience = cfg.hosts.restart_timeout
            weights.attach(session)
            say(f"{name}: joined the trainer at {cfg.hosts.hub}")
            # Continuous batching: the batches this session was handed, in the slot engine
            # (what a trainer before handed out is not this one's: a new engine per join).
            if isinstance(engine, EngineAgents):  # the last session's agents and server end
                engine.close()
            engine = None
            if agent is not None:  # its sessions served here, by this group's engine
                # Several processes: the leader runs the agents and serves their sessions.
                engine = EngineAgents(cfg, graphdef, tok, task, agent, mesh=mesh,
                                      slots=cfg.sampler.slots or batch_rows, curriculum=None,
                                      examples=task.train_examples, group=processes)  # fmt: skip
            elif on_engine and episodes is not None:  # episodes, as a colocated run's
                engine = EngineEpisodes(cfg, graphdef, tok, episodes, mesh=mesh,
                                        slots=cfg.sampler.slots or batch_rows,
                                        sampling=sampling, curriculum=None,
                                        examples=task.train_examples)  # fmt: skip
            elif on_engine:
                engine = EngineBatches(cfg, graphdef, tok, waves.interruption, mesh=mesh,
                                       prompt_len=-(-longest // 8) * 8, sampling=sampling,
                                       slots=cfg.sampler.slots or batch_rows)  # fmt: skip
            done_at = time.perf_counter()  # the last batch pushed (a batch's seconds)
            sent: dict[str, list] = {"sent": [], "sent_evals": []}  # this session's
            # An evaluation part handed out while the engine held batches: made once they
            # are done, with the engine's slots freed (in a batch's place, as planned).
            deferred = None
            while True:
                stopped, draining = processes.share([weights.stopped, drain.asked])
                if stopped:  # (the hub is gone once every group was told)
                    break
                held = engine is not None and bool(engine.queued)
                if draining and not held and deferred is None:
                    if lead:
                        _leave(control, session, sent, name, made)
                    return 0
                work = None
                if deferred is not None and not held:
                    work, deferred = deferred, None
                elif (not draining and deferred is None
                      and (engine is None or len(engine.queued) < _AHEAD)):  # fmt: skip
                    seq += 1
                    message = {"op": "work", "run": session["run"], "gen": session["gen"],
                               "seq": seq}  # fmt: skip
                    try:
                        work = ask(message, stopped=lambda: weights.stopped)
                    except TimeoutError as e:
                        _waiting(name, e, patience)
                        break
                    if work.get("stop"):
                        say(f"{name}: stopped by the trainer after {made} batch(es)")
                        return 0
                    if work.get("rejoin"):
                        break
                    if "batch" not in work and "eval" not in work:
                        if not held:
                            time.sleep(work.get("wait", 0.05))
                            continue
                        work = None
                    elif "eval" in work and held:
                        deferred, work = work, None
                what = f"batch {work.get('batch')}" if work else ""
                if work and "eval" in work:
                    what = f"evaluation {work['eval']} part {work['part']} of {work['version']}"
                if work:
                    say(f"{name}: generating {what}")
                try:
                    if work and "eval" in work:
                        if engine is not None:
                            engine.release()
                        agents = engine if agent is not None else None
                        frames = _evaluate_part(cfg, scorer, waves, weights, work, base, episodes,
                                                agents=agents)  # fmt: skip
                    elif work and (engine is None or (work["schedule"] is not None
                                                      and agent is None)):  # fmt: skip
                        frames = _make_batch(cfg, scorer, waves, weights, work, run_key,
                                             sampling, base, episodes, score=lead)  # fmt: skip
                    else:  # queued behind what the engine holds; one engine run
                        if work:
                            _queue(engine, task, work, run_key, weights, base)
                        frames = _engine_run(cfg, scorer, engine, weights, base, done_at,
                                             score=lead)  # fmt: skip
                except Rejoin:
                    break
                except TrainerLost as e:  # what it was making is lost; the hub counts it
                    _waiting(name, e, patience)
                    break
                except Stopped:  # said, not counted: the trainer has trained its last step
                    say(f"{name}: {what or 'the batches in the engine'} left unfinished")
                    break
                if frames is not None:
                    push(frames, session, sent)
                    made += 1
                    done_at = time.perf_counter()
            if processes.share(weights.stopped):
                say(f"{name}: stopped by the trainer after {made} batch(es)")
                return 0
    finally:
        if isinstance(engine, EngineAgents):
            engine.close()
        weights.close()
        if lead:
            control.close()
            data.close()
        client.close()
        if client.pulls:
            share = client.pulled_bytes / client.pulls / client.version_bytes
            print(f"{name}: pulled {client.pulls} version(s), {share:.2f} of each one's bytes",
                  flush=True)  # fmt: skip


# Batches a group's slot engine holds at once: the one it hands back next and the one queued
# behind it, whose groups take the slots the first one's finished rows leave.
_AHEAD = 2


def _queue(engine: EngineBatches | EngineEpisodes | EngineAgents, task, work: dict, run_key,
           weights: Weights, base) -> None:  # fmt: skip
    """The hub's batch into the slot engine, behind what it holds (held there until its
    bound, `oldest`); the work and the time come back with it. Episodes open their
    environments as they are queued; agents start (their sessions served by this group's
    engine, built with the first weights it holds)."""
    key = jax.random.fold_in(run_key, work["key"])  # (the engine's seed if it is the first)
    tag = (work, time.perf_counter())
    if isinstance(engine, EngineAgents):
        if engine.backend is None:
            engine.start(lora.merge_params(base, weights.get(at_least=work["oldest"])[1]))
        engine.queue(work["indices"], work["oldest"], tag=tag)
        return
    if isinstance(engine, EngineEpisodes):
        engine.queue(work["indices"], key, work["oldest"], tag=tag)
        return
    prompts = [task.tokenizer.encode(task.train_examples[i]["prompt"]) for i in work["indices"]]
    engine.queue(work["indices"], prompts, key, work["oldest"], tag=tag)


def _engine_run(cfg, scorer, engine: EngineBatches | EngineEpisodes, weights: Weights, base,
                done_at: float, *, score: bool = True):  # fmt: skip
    """One run of the slot engine with the newest weights held (at least the oldest queued
    batch's bound; the batch behind it is held by the engine until its own), or for
    episodes one step on (a run, or a short wait for their environments); the frames of the
    oldest batch if it is now complete (`score`: else it is dropped, as a follower of a
    group's leader drops it), else None."""
    oldest = engine.queued[0].tag[0]["oldest"]

    def params_for_chunk(chunk: int):
        version, params = weights.get(at_least=oldest)
        return version, lora.merge_params(base, params)

    engine.step(params_for_chunk)
    if not engine.complete():
        return None
    if isinstance(engine, EngineEpisodes | EngineAgents):  # (agents: any group)
        popped = engine.pop()
        if popped is None:  # a follower of the group's leader, which sends the batch
            return None
        _, ro, rewards, stats, (work, queued_at) = popped
        scored = score_episodes(cfg, ro, rewards, stats, reference=bool(cfg.loss.kl_coef))
        scored.stats.update(slot_occupancy=engine.occupancy, gen_engine=1)
        meta = engine.meta if isinstance(engine, EngineAgents) else None
        return _frames(scored, work, time.perf_counter() - max(queued_at, done_at), meta)
    _, ro, (work, queued_at) = engine.pop()
    if not score:
        return None
    return _scored_frames(cfg, scorer, ro, work, max(queued_at, done_at),
                          slot_occupancy=engine.occupancy, gen_engine=1)  # fmt: skip


class Drain:
    """SIGTERM drains the group (a preemptible host's notice, a scheduler scaling down, an
    operator): it takes no new work, finishes and sends what it holds, tells the hub it
    leaves once what it sent has arrived (nothing is handed out again, nothing counted lost),
    and exits 0. A second SIGTERM ends it at once. `asked` is set by the handler, which runs
    on the main thread, and read there."""

    def __init__(self, name: str):
        self.name, self.asked = name, False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.asked:
            raise SystemExit(128 + signum)
        self.asked = True
        print(f"{self.name}: draining (SIGTERM): finishing the work it holds, then leaving",
              flush=True)  # fmt: skip


def _leave(control: Requester, session: dict, sent: dict[str, list], name: str, made: int):
    """Tell the hub this drained group leaves, once what it sent has arrived there."""
    leave = {"op": "leave", "run": session["run"], "gen": session["gen"], **sent}
    try:
        while (reply := control.request(leave)).get("wait"):
            time.sleep(reply["wait"])
    except TimeoutError as e:  # the trainer is gone: nothing to tell it
        print(f"{name}: leaving without the trainer's answer ({e})", flush=True)
    print(f"{name}: drained; left the trainer after {made} batch(es)", flush=True)


def _waiting(name: str, why: BaseException, patience: float) -> None:
    print(f"{name}: lost the trainer ({why}); waiting up to {patience:.0f} s for it to come "
          "back (hosts.restart_timeout)", file=sys.stderr, flush=True)  # fmt: skip


def _make_batch(
    cfg,
    scorer,
    waves,
    weights: Weights,
    work: dict,
    run_key,
    sampling,
    base=None,
    episodes=None,
    score: bool = True,
) -> list[bytes] | None:
    """Generate and score one assigned batch; its frames for the hub. `base`: a LoRA run's
    base, under the adapters the trainer sends; `episodes`: a multi-turn task's runner;
    `score` False: generate only (a group's follower), None."""
    start = time.perf_counter()
    g = cfg.train.group_size
    task = scorer.task
    examples = [task.train_examples[i] for i in work["indices"]]
    schedule, swap_at = work["schedule"], work["swap_at"]

    def params_for_chunk(chunk: int):
        if schedule is not None:
            got = weights.get(version=schedule[0] if chunk < swap_at else schedule[1])
        else:
            got = weights.get(at_least=work["oldest"])
        return got[0], lora.merge_params(base, got[1])

    key = jax.random.fold_in(run_key, work["key"])
    if episodes is not None:  # whole episodes, as the trainer's own
        ro, rewards, stats = episodes.run(
            params_for_chunk, examples, key, sampling=sampling, repeat=g
        )
        scored = score_episodes(cfg, ro, rewards, stats, reference=bool(cfg.loss.kl_coef))
        scored.stats["gen_engine"] = 0  # static waves (the rows' gen_batching)
        return _frames(scored, work, time.perf_counter() - start)
    ro = waves.generate(
        params_for_chunk,
        [task.tokenizer.encode(e["prompt"]) for e in examples],
        key,
        sampling=sampling,
        n_new=cfg.sampler.max_new_tokens,
        repeat=g,
        with_fill=True,
    )
    ro = jax.tree.map(distributed.to_host, ro)  # (gathered on every process of a group)
    if not score:
        return None
    return _scored_frames(cfg, scorer, ro, work, start, gen_engine=0)


def _scored_frames(cfg, scorer, ro, work: dict, start: float, **stats) -> list[bytes]:
    """Score a batch's rollout (the work's prompts, in order): its frames for the hub, with
    `stats` beside the scores'."""
    examples = [scorer.task.train_examples[i] for i in work["indices"]]
    scored = score_rollout(cfg, scorer, ro, examples, reference=bool(cfg.loss.kl_coef))
    scored.stats.update(stats)
    return _frames(scored, work, time.perf_counter() - start)


def _frames(scored, work: dict, seconds: float, meta: list[dict] | None = None) -> list[bytes]:
    """A scored batch's frames for the hub; `meta`: what each row adds to rollouts.jsonl (an
    agent's session, branch and calls)."""
    arrays = {
        f: np.asarray(getattr(scored.ro, f))
        for f in ROLLOUT_FIELDS
        if getattr(scored.ro, f) is not None  # routes: router replay only
    }
    arrays.update(rewards=scored.rewards, pass_rates=scored.pass_rates,
                  indices=np.asarray(work["indices"]))  # fmt: skip
    header = {"batch": work["batch"], "stats": scored.stats, "seconds": seconds}
    if meta is not None:
        header["meta"] = meta
    return encode_batch(header, arrays)


def _evaluate_part(cfg, scorer, waves, weights: Weights, work: dict, base=None,
                   episodes=None, agents: EngineAgents | None = None) -> list[bytes]:  # fmt: skip
    """Score part of a held-out evaluation (examples lo..hi-1, k samples each) with exactly
    the version asked for; its frames for the hub (scores [hi - lo, k], counts). `agents`:
    an agent task's, whose agents run the part on an engine of its own."""
    version = work["version"]
    key = jax.random.wrap_key_data(np.asarray(work["key"], np.uint32))
    if work["parts"] > 1:  # each part draws its own samples
        key = jax.random.fold_in(key, work["part"])

    def params_for_chunk(chunk: int):
        got = weights.get(version=version)
        return -1, lora.merge_params(base, got[1])  # (the trainer's eval: no version recorded)

    examples = scorer.task.eval_examples[work["lo"] : work["hi"]]
    if agents is not None:
        scores, counts = agents.evaluate(params_for_chunk(0)[1], examples)
    else:
        scores, counts = held_out_scores(cfg, scorer, waves.generate, episodes,
                                         params_for_chunk, examples, key)  # fmt: skip
    counts = {k: v.item() if hasattr(v, "item") else v for k, v in counts.items()}
    header = {"eval": work["eval"], "part": work["part"], "counts": counts}
    return encode_batch(header, {"scores": np.asarray(scores, np.float64)})


def main(cfg: ExperimentConfig, group: int) -> int:
    try:
        return run_generator(cfg, group)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except ConfigError as e:  # it would fail so again: the trainer's run ends with it
        if jax.process_index() == 0:  # (a group's leader speaks for it)
            _report(cfg, group, str(e), kind="config")
        raise
    except (ScorerBroken, PoolBroken) as e:  # broken scoring, here as on any group
        if jax.process_index() == 0:
            _report(cfg, group, f"{type(e).__name__}: {e}", kind="scoring")
        raise


def _report(cfg: ExperimentConfig, group: int, error: str, *, kind: str) -> None:
    """Tell the trainer's hub that this group failed for good (`error` names the key, or the
    scorer's failure: `kind` "config" or "scoring"), so its run ends now with that error
    rather than waiting for the group; waits up to `hosts.timeout` for a trainer to answer
    (one starting after this group)."""
    control = Requester(cfg.hosts.hub, patience=cfg.hosts.timeout, what=f"generator group {group}")
    message = {"op": "fail", "group": group, "host": address(cfg, trainer=False),
               "error": error, "kind": kind}  # fmt: skip
    try:
        control.request(message)
        print(f"generator group {group}: told the trainer ({error})", file=sys.stderr,
              flush=True)  # fmt: skip
    except TimeoutError as e:
        print(f"generator group {group}: could not tell the trainer ({e})", file=sys.stderr,
              flush=True)  # fmt: skip
    finally:
        control.close()
