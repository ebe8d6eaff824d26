"""`jaxrl-scale serve`: load a policy, start its engine thread, serve the OpenAI API with
uvicorn until SIGTERM or SIGINT, then stop within `SHUTDOWN_S` seconds of it."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxrl_scale.serve")
GRACE_S = 5  # open responses get this long after a signal before they are cancelled
SHUTDOWN_S = 15  # the most a signal-to-exit takes: GRACE_S, the engine's close, the rest


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def check_exposure(host: str, api_key: str | None, allow_remote_without_key: bool) -> None:
    """Refuse to serve beyond this machine without a key, unless told to."""
    if api_key is None and not is_loopback(host) and not allow_remote_without_key:
        raise ValueError(
            f"--host {host} is reachable from other machines and there is no API key: give "
            "--api-key (or JAXRL_API_KEY), or --allow-remote-without-key if that is intended"
        )


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
        from jaxrl_scale.config import load_config
        from jaxrl_scale.configbase import ConfigError

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

    from jaxrl_scale.config import load_config
    from jaxrl_scale.parallel import sharding

    cfg = load_config(config, overrides or [])
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.local_devices())
    return mesh if mesh.devices.size > 1 else None


def _devices():
    import jax

    return jax.local_devices()[:1]


def run_server(app, host: str, port: int) -> None:
    """Serve `app` until SIGTERM / SIGINT; returns once every response ended or was cancelled
    (GRACE_S after the signal)."""
    import uvicorn

    sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="info", access_log=False, timeout_graceful_shutdown=GRACE_S, lifespan="off"
    )
    server = uvicorn.Server(config)
    # uvicorn puts back the handlers it found and raises the signal again once it stopped:
    # these let the caller close the engine and exit 0 instead of dying there.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log.info("serving on http://%s:%d/v1", host, bound)
    server.run(sockets=[sock])


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET
