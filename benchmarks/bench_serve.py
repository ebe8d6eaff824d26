"""The HTTP server's overhead: the slot engine driven directly vs the same requests through
`jaxrl-scale serve`'s app (uvicorn on 127.0.0.1, streaming clients), in one process and run.

    python benchmarks/bench_serve.py [--clients 64] [--new 128] [--slots 64] [--repeats 3]

Every request is a seeded completion of token ids (temperature 1), so each path generates the
same tokens (a row's draws depend on its seed alone): the token counts agree, and tokens/s
compare the paths' speed alone. Paths: `engine` (a loop of SlotEngine.run with every request
submitted up front, reading the rows' progress as the server's engine thread does), `http`
(`--clients` concurrent streaming clients of /v1/completions, httpx, in a process of their
own as clients are; on this machine's cores beside the server). Prints for each repeat:
generated tokens/s of both and http / engine (goal >= 0.85), time to first token with 1
client and with `--clients`, requests/s, and the programs compiled while serving (0: the
server warmed up); then the medians; each for the HTTP server in a process of its own
(`jaxrl-scale serve`'s default, serve/remote.py) and on a thread of the engine's process
(`--http-in-process`); then the HTTP layer alone: tokens/s through a backend
that costs nothing, the most this server streams on this machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time

import jax
import numpy as np
from flax import nnx

from jaxrl_scale.config import ModelConfig
from jaxrl_scale.generation.engine import RowSampling, SlotEngine
from jaxrl_scale.generation.sampler import Sampling
from jaxrl_scale.models.policy import init_policy
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.serve.app import make_app
from jaxrl_scale.serve.backend import Delta, Generation
from jaxrl_scale.serve.engine import EngineBackend

PROMPT_LEN = 16
VOCAB = 512  # the tokenizer's 257 ids, rounded up


def _model(args):
    """A random-init policy and a byte-level tokenizer (256 byte tokens and an end token)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>"])
    tok = Tokenizer(backend, eos_ids=[backend.token_to_id("<|end|>")])
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_layers=args.layers, num_heads=4, num_kv_heads=2)  # fmt: skip
    return init_policy(cfg, seed=0), tok


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, PROMPT_LEN)).tolist()


def run_engine(model, tok, args) -> tuple[int, float]:
    """Generated tokens and seconds: the engine alone, every request up front."""
    graphdef, params = nnx.split(model)
    # The server's engine (EngineBackend): prompt_len half the context, completion columns
    # for a whole context.
    engine = SlotEngine(graphdef, slots=args.slots, prompt_len=args.context // 2,
                        n_new=args.context, repeat=1, sampling=Sampling(1.0),
                        eos_ids=tok.eos_ids, pad_id=tok.pad_id, model_cfg=model.cfg,
                        per_row_sampling=True, top_logprobs=20)  # fmt: skip
    start = time.perf_counter()
    for i, p in enumerate(_prompts(args.clients)):
        engine.submit(i, p, max_new=args.new, sampling=RowSampling(1.0, 1.0, (i, 0)))
    tokens = 0
    while engine.busy or engine.pending:
        for f in engine.run(params, 0, args.steps):
            tokens += f.length
        engine.peek(window=args.steps, top=False)  # what the server's engine thread reads
    return tokens, time.perf_counter() - start


class Served:
    """The app on uvicorn in a thread, on a free loopback port (`backend` default: the
    engine's)."""

    def __init__(self, model, tok, args, backend=None):
        import uvicorn

        self.backend = backend or EngineBackend(model, tok, slots=args.slots, context=args.context,
                                                max_queue=4 * args.clients, steps=args.steps,
                                                warm_up=True)  # fmt: skip
        app = make_app(self.backend, tok, model_name="bench")
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)  # fmt: skip
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.backend.close()


class SplitServed:
    """`jaxrl-scale serve`'s default: the app in a process of its own (serve/remote.py's
    Front) over the sockets, the engine here behind the Relay (its loop on a thread)."""

    def __init__(self, model, tok, args):
        from jaxrl_scale.serve.remote import Front

        self.backend = EngineBackend(model, tok, slots=args.slots, context=args.context,
                                     max_queue=4 * args.clients, steps=args.steps,
                                     warm_up=True)  # fmt: skip
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.front = Front(self.backend, tok, model_name="bench", slots=args.slots,
                           max_queue=4 * args.clients, host="127.0.0.1",
                           port=self.port)  # fmt: skip
        self.thread = threading.Thread(target=self.front.relay.serve,
                                       args=(lambda: self.front.proc.poll() is not None,),
                                       daemon=True)  # fmt: skip
        self.thread.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.front.proc.poll() is not None:
                    raise RuntimeError("the front process did not start") from None
                time.sleep(0.1)

    def close(self):
        self.front.proc.terminate()
        self.front.proc.wait(30)
        self.thread.join(15)
        self.front.close()
        self.backend.close()


class _Instant:
    """The backend protocol at no cost: every choice gets `steps` tokens (random bytes, as a
    random model's) each `round_s`, pushed as the engine's thread pushes them. Through it the
    HTTP layer alone sets the pace: the most tokens/s this server streams on this CPU, to set
    beside what an accelerator's engine makes."""

    model_name = "bench"

    def __init__(self, steps: int, context: int, round_s: float = 0.002):
        self.steps, self.context, self.round_s = steps, context, round_s
        self._lock = threading.Lock()  # the event loop submits, this thread streams
        self._new: list = []
        self._closed = False
        self._rng = np.random.default_rng(0)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, request, loop):
        generation = Generation(request, loop, self)
        with self._lock:
            self._new.append([generation, 0])
        return generation

    def cancel(self, generation, choices) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"queue_length": 0, "slots": 0, "slots_busy": 0}

    def close(self) -> None:
        self._closed = True
        self._thread.join(10)

    def _loop(self) -> None:
        live: list = []  # this thread's
        while not self._closed:
            with self._lock:
                live, self._new = live + self._new, []
            out = []
            for row in list(live):
                generation, sent = row
                k = min(self.steps, generation.request.max_new - sent)
                row[1] += k
                done = row[1] >= generation.request.max_new
                ids = tuple(int(t) for t in self._rng.integers(0, 256, k))
                finish = "length" if done else None
                out.append((generation, Delta(0, ids, (-1.0,) * k, None, finish)))
                if done:
                    live.remove(row)
            Generation.push_all(out)
            time.sleep(self.round_s)


async def _client(http, url, prompt, seed, new) -> tuple[int, float, float]:
    """(tokens, seconds to the first token, seconds in all) of one streaming completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 1.0,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first or 0.0, time.perf_counter() - start


def _clients(port: int, prompts, new: int, out) -> None:
    """In a process of its own (clients live elsewhere than the server): every prompt as a
    streaming client at once; puts (results, seconds) on `out`."""
    try:
        import httpx2 as httpx  # the openai SDK's HTTP client (the test extra)
    except ImportError:  # where the SDK is not installed (an accelerator's image)
        import httpx

    url = f"http://127.0.0.1:{port}/v1/completions"

    async def every():
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(limits=limits) as http:
            return await asyncio.gather(
                *(_client(http, url, p, i, new) for i, p in enumerate(prompts))
            )

    import resource

    def cpu() -> float:
        used = resource.getrusage(resource.RUSAGE_SELF)
        return used.ru_utime + used.ru_stime

    start, cpu0 = time.perf_counter(), cpu()
    results = asyncio.run(every())
    out.put((results, time.perf_counter() - start, cpu() - cpu0))


def run_http(served: Served, args, clients: int) -> tuple[int, float, list[float]]:
    """Generated tokens, seconds and each client's time to first token: `clients` streaming
    clients in another process."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_clients, args=(served.port, _prompts(args.clients)[:clients],
                                              args.new, out))  # fmt: skip
    proc.start()
    results, seconds, cpu = out.get(timeout=900)
    proc.join(30)
    print(f"  (clients' process: {cpu:.2f} s of CPU in {seconds:.2f} s)")
    return sum(r[0] for r in results), seconds, [r[1] for r in results]


_COMPILES = [0]  # programs compiled (XLA backend compiles) in this process so far


def _count_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per engine run")
    parser.add_argument("--context", type=int, default=256, help="the engine's context")
    parser.add_argument("--http", nargs="+", choices=("process", "thread"),
                        default=["process", "thread"],
                        help="where the HTTP server runs: a process of its own (serve's "
                        "default), a thread of the engine's (--http-in-process)")  # fmt: skip
    args = parser.parse_args()
    if PROMPT_LEN + args.new > args.context:
        parser.error(
            f"--new {args.new} and a {PROMPT_LEN}-token prompt exceed --context {args.context}"
        )
    model, tok = _model(args)
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.clients} clients, "
          f"{args.slots} slots, up to {args.new} tokens each")  # fmt: skip
    run_engine(model, tok, args)  # compile the engine's path first
    for where in args.http:
        served = Served(model, tok, args) if where == "thread" else SplitServed(model, tok, args)
        place = {
            "thread": "a thread of the engine's process (--http-in-process)",
            "process": "a process of its own (jaxrl-scale serve's default)",
        }[where]
        print(f"-- the HTTP server on {place}")
        run_http(served, args, args.clients)  # (the first burst: any compile left)
        ratios, ttft1, ttft_n, rps = [], [], [], []
        try:
            for r in range(args.repeats):
                e_tokens, e_s = run_engine(model, tok, args)
                before = _COMPILES[0]
                h_tokens, h_s, firsts = run_http(served, args, args.clients)
                _, _, one = run_http(served, args, 1)
                compiled = _COMPILES[0] - before
                ratio = (h_tokens / h_s) / (e_tokens / e_s)
                ratios.append(ratio)
                ttft1.append(one[0])
                ttft_n.append(statistics.median(firsts))
                rps.append(args.clients / h_s)
                print(f"repeat {r}: engine {e_tokens / e_s:8.0f} tok/s ({e_tokens} tokens), http "
                      f"{h_tokens / h_s:8.0f} tok/s ({h_tokens} tokens), http/engine "
                      f"{ratio:.3f}; TTFT 1 client {one[0] * 1e3:.0f} ms, {args.clients} clients "
                      f"median {ttft_n[-1] * 1e3:.0f} ms; {rps[-1]:.1f} requests/s; {compiled} "
                      f"programs compiled while serving")  # fmt: skip
        finally:
            served.close()
        print(
            f"median ({where}): http/engine {statistics.median(ratios):.3f} (goal >= 0.85); "
            f"TTFT 1 client {statistics.median(ttft1) * 1e3:.0f} ms, {args.clients} clients "
            f"{statistics.median(ttft_n) * 1e3:.0f} ms; {statistics.median(rps):.1f} requests/s"
        )
    # The HTTP layer alone, with long completions: what the server can stream at most.
    long = argparse.Namespace(**{**vars(args), "new": 1024})
    served = Served(model, tok, long, backend=_Instant(args.steps, context=PROMPT_LEN + 1024))
    try:
        rates = []
        for _ in range(args.repeats):
            tokens, seconds, _ = run_http(served, long, args.clients)
            rates.append(tokens / seconds)
    finally:
        served.close()
    print(f"http layer alone (a backend that costs nothing, {args.clients} clients x 1024 "
          f"tokens): median {statistics.median(rates):.0f} tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
