"""Serving the app: who may connect (`check_exposure`), and uvicorn until SIGTERM or SIGINT,
then a stop within `SHUTDOWN_S` seconds of it. Loading the policy is the command's
(jaxrl_scale/serving.py), above the run's parts."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket

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


class Background:
    """`app` served by uvicorn on a thread of this process, on 127.0.0.1 and a free port
    (`url`), until `close` (a trainer's sessions for its agents: rl/agents.py)."""

    def __init__(self, app, timeout: float = 60.0):
        import threading
        import time

        import uvicorn

        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="jaxrl-agent-server", daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agents' OpenAI server did not start")
            time.sleep(0.01)

    def close(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET
