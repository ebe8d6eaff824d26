"""`jaxrl-scale serve`: the policy to serve (a Hugging Face folder, a run's newest checkpoint,
or a config's model.init_from), the mesh it is served on, then serve/'s app on uvicorn. This
sits beside the commands (it reads runs and configs); serve/ itself stands below rl/.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from jaxrl_scale.config import load_config
from jaxrl_scale.configbase import ConfigError


def load_policy(
    *,
    init_from: str | None = None,
    run: Path | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> tuple[Any, Any, str]:
    """(model, tokenizer, default served name) from a Hugging Face folder, a run directory
    (its newest checkpoint, LoRA merged) or an experiment config (its model.init_from)."""
    if config is None and any(not o.startswith("mesh.") for o in overrides or []):
        raise ValueError(
            "--set: without --config only mesh.* is read (where the policy is served); a run "
            "or a Hugging Face folder is served as it is"
        )
    if run is not None:
        from jaxrl_scale.train import load_run_policy

        policy = load_run_policy(run, devices=_devices())
        return policy.model, policy.tokenizer, Path(run).absolute().name
    if config is not None:
        cfg = load_config(config, overrides or [])
        if cfg.model.init_from is None:
            raise ConfigError(f"{config}: model.init_from is not set (no checkpoint to serve)")
        if cfg.model.lora.enabled:
            raise ConfigError(
                f"{config}: model.lora is set; serve the run that trained the adapters (--run)"
            )
        init_from = cfg.model.init_from
        fields = cfg.model.runtime_fields()
    else:
        fields = {}
    from jaxrl_scale.models.hf import load_pretrained

    model, tokenizer = load_pretrained(init_from, **fields)
    return model, tokenizer, Path(str(init_from).removeprefix("asset:")).name


def serving_mesh(config: str | None = None, overrides: list[str] | None = None):
    """The mesh the policy is served on, as training lays out its trainer's devices: the
    config's `mesh` (with its --set overrides) over this process's devices, when --config or
    a `--set mesh.*` says one; else None, one device. The engine's slots split over its
    batch axes (`--slots` a multiple of them), the weights by their logical axes."""
    if config is None and not overrides:
        return None
    import jax

    from jaxrl_scale.parallel import sharding

    cfg = load_config(config, overrides or [])
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.local_devices())
    return mesh if mesh.devices.size > 1 else None


def _devices():
    import jax

    return jax.local_devices()[:1]


def serve(args) -> int:
    """`jaxrl-scale serve` with its parsed arguments: load, build the engine, serve."""

    from jaxrl_scale.serve.app import make_app
    from jaxrl_scale.serve.engine import EngineBackend
    from jaxrl_scale.serve.server import check_exposure, run_server

    api_key = args.api_key or os.environ.get("JAXRL_API_KEY") or None
    check_exposure(args.host, api_key, args.allow_remote_without_key)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model, tokenizer, name = load_policy(
        init_from=args.init_from, run=args.run, config=args.serve_config, overrides=args.overrides
    )
    name = args.served_model_name or name
    mesh = serving_mesh(args.serve_config, args.overrides)
    slots = args.slots
    if slots is None:  # a config's sampler.slots (with its --set overrides), as in training
        if args.serve_config is not None:
            slots = load_config(args.serve_config, args.overrides).sampler.slots
        slots = slots or 16
    if mesh is not None:  # the weights by their logical axes, the slots over the batch axes
        from jaxrl_scale.parallel.sharding import shard_module

        model = shard_module(model, mesh)
    try:
        backend = EngineBackend(
            model,
            tokenizer,
            slots=slots,
            context=args.context,
            # Split, the HTTP process keeps the queue's bound (serve/remote.py).
            max_queue=args.max_queue if args.http_in_process else 2**31,
            mesh=mesh,
            model_name=name,
            warm_up=args.warm_up,
        )
    except ValueError as e:  # e.g. slots that do not split over the mesh's batch axes
        raise ConfigError(f"--slots / --set mesh.*: {e}") from None
    try:
        if args.http_in_process:
            run_server(make_app(backend, tokenizer, api_key=api_key), args.host, args.port)
            return 0
        return _serve_split(backend, tokenizer, name, slots, api_key, args)
    finally:
        backend.close(timeout=5)  # (the engine's thread ends at its next turn)


def _serve_split(backend, tokenizer, name: str, slots: int, api_key, args) -> int:
    """The HTTP server in a process of its own (serve/remote.py), this process relaying its
    requests to `backend` until the front exits: after SIGTERM / SIGINT (passed on to it:
    it answers what is open within its grace, then exits), or by itself (its exit status)."""
    import signal
    import subprocess

    from jaxrl_scale.serve.remote import Front
    from jaxrl_scale.serve.server import GRACE_S, SHUTDOWN_S

    log = logging.getLogger("jaxrl_scale.serve")
    signalled: list[float] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signalled.append(time.monotonic()))
    front = Front(backend, tokenizer, model_name=name, slots=slots, max_queue=args.max_queue,
                  host=args.host, port=args.port, api_key=api_key)  # fmt: skip
    passed_on = False

    def stop() -> bool:
        nonlocal passed_on
        if signalled and not passed_on:
            passed_on = True
            with contextlib.suppress(ProcessLookupError):
                front.proc.send_signal(signal.SIGTERM)
        if signalled and time.monotonic() - signalled[0] > GRACE_S + 2:
            front.proc.kill()  # it had its grace to answer what was open
        return front.proc.poll() is not None

    try:
        front.relay.serve(stop)  # (returns once the front said it closed, or exited)
        try:
            code = front.proc.wait(timeout=GRACE_S + 2)
        except subprocess.TimeoutExpired:
            front.proc.kill()
            code = front.proc.wait()
    finally:
        if front.proc.poll() is None:
            front.proc.kill()
            front.proc.wait()
        backend.close(timeout=SHUTDOWN_S - GRACE_S - 5)  # its thread sends to the relay
        front.close()
    if signalled:
        return 0
    if code:
        log.error("the HTTP server's process exited with status %s", code)
    return code if code >= 0 else 1  # (killed by a signal: -signal)
