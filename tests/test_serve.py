"""`jaxrl-scale serve`: the OpenAI API (serve/app.py) answering the real `openai` SDK over
HTTP on 127.0.0.1, in front of two backends: `Scripted` (below: answers chosen by the prompt,
so tool calls, thinking, stop strings and a full queue can be asked for) and the slot engine
(`EngineBackend`) on a tiny random Qwen3 checkpoint with the published Qwen3 chat template.
One server per backend per module; every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

import httpx
import numpy as np
import openai
import pytest
import tokenizers
from conftest import FIXTURES, ROOT, xla_flags

from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.serve.backend import Delta, Generation, QueueFull, Request
from jaxrl_scale.serve.text import ChoiceText

KEY = "test-key"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # text, as in Qwen's vocabulary
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
WAIT_S = 60  # the most any single wait of these tests takes


def qwen3_tokenizer() -> Tokenizer:
    """Bytes as tokens (any text round-trips), Qwen's special and added tokens, and the
    published Qwen3 chat template."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL)
    backend.add_tokens([tokenizers.AddedToken(t, special=False) for t in ADDED])
    template = ChatTemplate(
        (FIXTURES / "chat_templates" / "qwen3.jinja").read_text(),
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    ids = [backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return Tokenizer(backend, eos_ids=ids, pad_id=ids[1], chat_template=template)


# --------------------------------------------------------------------------- a scripted backend


class Scripted:
    """The `Backend` protocol on a thread of its own, like the engine's: `slots` choices decode
    at once, one token per `tick` each; more wait (up to `max_queue` requests, then QueueFull).
    What a choice says depends on the prompt's last user words:
      TOOL   a Qwen tool call of `add`;      THINK  a think block, then the answer;
      (a prompt that ends in a call's opening: the rest of a call of `add`; BAD: no JSON)
      LONG   tokens until max_tokens;        HOLD   nothing until `release` is set;
      else   "Hello there! This is choice {i}."; every answer ends with <|im_end|>."""

    context = 2048
    model_name = "scripted"

    def __init__(
        self, tokenizer: Tokenizer, *, slots: int = 4, max_queue: int = 64, tick: float = 0.002
    ):
        self.tokenizer, self.slots, self.max_queue, self.tick = tokenizer, slots, max_queue, tick
        self.end = tokenizer.backend.token_to_id("<|im_end|>")
        self.release = threading.Event()
        self.release.set()
        self.cancelled: list[tuple[Request, int]] = []
        self._lock = threading.Lock()
        self._inbox: deque = deque()
        self._waiting: deque = deque()  # [generation, index, tokens]
        self._running: list = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="scripted-backend", daemon=True)
        self._thread.start()

    def reply(self, request: Request, index: int) -> tuple[list[int], bool]:
        """Choice `index`'s tokens, and whether it waits for `release`."""
        prompt = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        user = prompt.rsplit("<|im_start|>user", 1)[-1]
        if prompt.endswith(('"arguments": ', '{"name": "')):  # a call's opening was given
            text = ("" if prompt.endswith(": ") else 'add", "arguments": ') + (
                '{"a": 1, "b": 2}}\n</tool_call>' if "BAD" not in user else "{oops"
            )
            return self.tokenizer.encode(text) + [self.end], False
        if "TOOL" in user:
            text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        elif "THINK" in user:
            text = "<think>\nhmm, 2 + 2\n</think>\n\nThe answer is 4."
        elif "LONG" in user:
            letters = "".join(chr(ord("a") + k % 26) for k in range(request.max_new))
            return self.tokenizer.encode(letters), False
        else:
            text = f"Hello there! This is choice {index}."
        return self.tokenizer.encode(text) + [self.end], "HOLD" in user

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Generation:
        if len(request.prompt_ids) + request.max_new > self.context:
            raise ValueError("over the context")
        generation = Generation(request, loop, self)
        with self._lock:
            if len({id(row[0]) for row in self._waiting}) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} choices wait")
            for i in range(request.n):
                self._waiting.append([generation, i, *self.reply(request, i), 0])
        return generation

    def cancel(self, generation: Generation, choices: list[int]) -> None:
        with self._lock:
            self._inbox.append((generation, set(choices)))

    def stats(self) -> dict[str, float]:
        with self._lock:
            waiting = len({id(row[0]) for row in self._waiting})
            return {"queue_length": waiting, "slots": self.slots, "slots_busy": len(self._running)}

    def close(self) -> None:
        self._closed = True
        self._thread.join(WAIT_S)

    def _loop(self) -> None:
        while not self._closed:
            self._tick()  # (its locals, the rows it decoded, go with each tick)
            time.sleep(self.tick)

    def _tick(self) -> None:
        with self._lock:
            while self._inbox:
                generation, gone = self._inbox.popleft()
                for rows in (self._waiting, self._running):
                    for row in [r for r in rows if r[0] is generation and r[1] in gone]:
                        rows.remove(row)
                        self.cancelled.append((generation.request, row[1]))
            while self._waiting and len(self._running) < self.slots:
                self._running.append(self._waiting.popleft())
            running = list(self._running)
        for row in running:
            generation, index, tokens, hold, emitted = row
            if hold and not self.release.is_set():
                continue
            token, row[4] = tokens.pop(0), emitted + 1
            r = generation.request
            finish = None
            if token == self.end:
                finish = "stop"
            elif row[4] >= r.max_new or not tokens:
                finish = "length"
            k = r.top_logprobs
            top = ((token, -0.5), *((t, -2.0 - t / 100) for t in range(k - 1)))
            generation.push(Delta(index, (token,), (-0.5,), (top,) if k else None, finish))
            if finish is not None:
                with self._lock:
                    if row in self._running:
                        self._running.remove(row)


# --------------------------------------------------------------------------- servers


class Server:
    """uvicorn serving `app` (in front of `backend`) on 127.0.0.1 (a free port) in a thread
    of this process."""

    def __init__(self, app, backend):
        import uvicorn

        self.backend = backend

        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=WAIT_S, **kw
        )

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def scripted(tokenizer):
    from jaxrl_scale.serve.app import make_app

    backend = Scripted(tokenizer)
    server = Server(make_app(backend, tokenizer, api_key=KEY, max_body_bytes=64_000), backend)
    yield server
    server.close()
    backend.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A tiny random Qwen3 policy over the byte tokenizer, as a Hugging Face folder with its
    chat template (what `jaxrl-scale serve --init-from` reads)."""
    from jaxrl_scale.config import ModelConfig
    from jaxrl_scale.models.hf import save_pretrained
    from jaxrl_scale.models.policy import init_policy

    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        qk_norm=True,
    )
    return save_pretrained(init_policy(cfg, seed=3), tokenizer, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    from jaxrl_scale.models.hf import load_pretrained
    from jaxrl_scale.serve.app import make_app
    from jaxrl_scale.serve.engine import EngineBackend

    model, tok = load_pretrained(checkpoint)
    backend = EngineBackend(model, tok, slots=4, context=1024, max_queue=64, model_name="tiny")
    server = Server(make_app(backend, tok, api_key=KEY), backend)
    server.tokenizer = tok
    yield server
    server.close()
    backend.close()


@pytest.fixture(scope="module")
def remote(checkpoint, tmp_path_factory):
    """The two sides of `jaxrl-scale serve`'s split over their sockets: the engine behind a
    Relay (its loop on a thread here, the engine process's main thread there) and the app
    over a RemoteBackend."""
    from jaxrl_scale.models.hf import load_pretrained
    from jaxrl_scale.serve.app import make_app
    from jaxrl_scale.serve.engine import EngineBackend
    from jaxrl_scale.serve.remote import Relay, RemoteBackend

    model, tok = load_pretrained(checkpoint)
    engine = EngineBackend(model, tok, slots=4, context=1024, max_queue=64, model_name="tiny")
    directory = tmp_path_factory.mktemp("relay")
    relay = Relay(engine, directory)
    done = threading.Event()
    loop = threading.Thread(target=relay.serve, args=(done.is_set,), name="relay", daemon=True)
    loop.start()
    backend = RemoteBackend(directory, context=1024, model_name="tiny", slots=4, max_queue=64)
    server = Server(make_app(backend, tok, api_key=KEY), backend)
    server.tokenizer, server.engine, server.relay = tok, engine, relay
    yield server
    server.close()
    backend.close()
    loop.join(WAIT_S)  # the front's close ends the relay's loop
    assert not loop.is_alive()
    relay.close()
    engine.close()


def chat(server: Server, content: str, **kw):
    return server.client().chat.completions.create(
        model=server.backend.model_name, messages=[{"role": "user", "content": content}], **kw
    )


def wait_idle(backend, timeout: float = WAIT_S) -> dict:
    """The backend's stats once no slot is busy and nothing waits."""
    deadline = time.monotonic() + timeout
    while True:
        stats = backend.stats()
        if (stats["slots_busy"], stats["queue_length"]) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def raw(
    server: Server,
    body: bytes,
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    headers: dict | None = None,
) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a request sent as given."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        sent = {
            "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/json",
            **(headers or {}),
        }
        conn.request(method, path, body=body, headers={k: v for k, v in sent.items() if v})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null"), dict(response.headers)
    finally:
        conn.close()


# --------------------------------------------------------------------------- the API (scripted)


def test_models_health_and_a_chat(scripted, tokenizer):
    client = scripted.client()
    assert [m.id for m in client.models.list().data] == ["scripted"]
    status, health, _ = raw(scripted, b"", "/health", method="GET")
    assert status == 200 and health["status"] == "ok" and health["slots"] == 4
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="scripted", messages=messages, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.message.content == "Hello there! This is choice 0."
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    # The exact ids: the prompt as the chat template renders it, the reply with its <|im_end|>.
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert r.model_extra["prompt_token_ids"] == prompt
    ids = choice.model_extra["token_ids"]
    assert ids == tokenizer.encode(choice.message.content) + [scripted.backend.end]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))
    assert r.usage.total_tokens == len(prompt) + len(ids)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_stream_equals_the_whole_response(scripted):
    whole = chat(scripted, "hi", n=2)
    chunks = list(chat(scripted, "hi", n=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    for i in range(2):
        text = "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        assert text == whole.choices[i].message.content == f"Hello there! This is choice {i}."
        finishes = [
            c.choices[0].finish_reason
            for c in chunks
            if c.choices and c.choices[0].index == i and c.choices[0].finish_reason
        ]
        assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_and_logprobs(scripted, tokenizer):
    r = chat(scripted, "hi", n=3, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        assert c.message.content == f"Hello there! This is choice {i}."
        tokens = c.logprobs.content
        assert len(tokens) == len(tokenizer.encode(c.message.content)) + 1  # <|im_end|> too
        assert "".join(t.token for t in tokens) == c.message.content + "<|im_end|>"
        assert all(t.logprob == -0.5 and len(t.top_logprobs) == 2 for t in tokens)
        assert tokens[0].bytes == list(tokens[0].token.encode())
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    streamed = chat(scripted, "hi", logprobs=True, stream=True)
    pieces = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in pieces] == [t.token for t in r.choices[0].logprobs.content]


def test_tool_calls_parsed_and_tools_rendered(scripted, tokenizer):
    r = chat(
        scripted, "TOOL please add 1 and 2", tools=TOOLS, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "add"' in prompt  # the template saw the tools
    # Streamed: the call arrives whole in one delta.
    chunks = list(chat(scripted, "TOOL please", tools=TOOLS, stream=True))
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "add", {"a": 1, "b": 2})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The conversation goes on: the call and its result are rendered back.
    messages = [
        {"role": "user", "content": "add 1 and 2"},
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    again = scripted.client().chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS
    )
    assert again.choices[0].message.content == "Hello there! This is choice 0."
    # Without tools in the request, no call is parsed: the text is content.
    plain = chat(scripted, "TOOL please")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("<tool_call>")
    assert plain.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in chat(scripted, "TOOL", stream=True)
    )
    assert streamed == plain.choices[0].message.content


def test_tool_choice_required_or_named_makes_a_call(scripted, tokenizer):
    """ "required" and a named function start the answer with the call's opening (in the
    prompt's ids: the model writes only the rest); the call comes back parsed, streamed or
    not, and arguments the model breaks come back as content."""
    named = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        r = chat(scripted, "hello", tools=TOOLS, tool_choice=choice,
                 extra_body={"return_token_ids": True})  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        ((call),) = c.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "add",
            {"a": 1, "b": 2},
        )
        prompt = tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n{\"name\": \"" +
                               ('add", "arguments": ' if choice is named else ""))  # fmt: skip
        sampled = tokenizer.decode(c.model_extra["token_ids"], skip_special_tokens=False)
        assert not sampled.startswith("<tool_call>")  # the opening was given, not sampled
        chunks = list(chat(scripted, "hello", tools=TOOLS, tool_choice=choice, stream=True))
        calls = [t for k in chunks if k.choices for t in (k.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            ("add", {"a": 1, "b": 2})
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    bad = chat(scripted, "BAD", tools=TOOLS, tool_choice=named).choices[0]
    assert bad.message.tool_calls is None and bad.finish_reason == "stop"
    assert bad.message.content == '<tool_call>\n{"name": "add", "arguments": {oops'


def test_reasoning_content(scripted):
    r = chat(scripted, "THINK: what is 2 + 2?")
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "\nhmm, 2 + 2\n"
    assert message.content == "\n\nThe answer is 4."
    chunks = list(chat(scripted, "THINK: what is 2 + 2?", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "\nhmm, 2 + 2\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nThe answer is 4."


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_a_choice(scripted, tokenizer, stream):
    """ "de" spans two tokens: "d" is held back until "e" shows it is the stop string; the
    choice ends there and the engine stops generating it (cancelled, its slot freed)."""
    before = len(scripted.backend.cancelled)
    kw = {"max_tokens": 500, "stop": ["de", "zzz"], "extra_body": {"return_token_ids": True}}
    if stream:
        chunks = list(chat(scripted, "LONG", stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        ids = [i for c in chunks for i in c.choices[0].model_extra.get("token_ids") or []]
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = chat(scripted, "LONG", **kw)
        text, ids = r.choices[0].message.content, r.choices[0].model_extra["token_ids"]
        finish = r.choices[0].finish_reason
    assert (text, finish) == ("abc", "stop")
    assert tokenizer.decode(ids) == "abcde"  # up to the token that completed the stop string
    assert wait_idle(scripted.backend)["slots_busy"] == 0
    assert len(scripted.backend.cancelled) == before + 1


def test_length_and_max_completion_tokens(scripted):
    r = chat(scripted, "LONG", max_tokens=5)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("abcde", "length")
    r = chat(scripted, "LONG", max_completion_tokens=3)
    assert (r.choices[0].message.content, r.usage.completion_tokens) == ("abc", 3)


def test_completions(scripted, tokenizer):
    client = scripted.client()
    r = client.completions.create(
        model="scripted",
        prompt="LONG story:",
        max_tokens=4,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, r.object) == ("abcd", "length", "text_completion")
    assert choice.logprobs.tokens == list("abcd") and choice.logprobs.text_offset == [0, 1, 2, 3]
    assert choice.logprobs.token_logprobs == [-0.5] * 4
    assert [len(t) for t in choice.logprobs.top_logprobs] == [2] * 4
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode("LONG story:")
    assert r.usage.prompt_tokens == len("LONG story:")  # one byte, one token
    # Token ids as the prompt; the default max_tokens is OpenAI's 16.
    ids = tokenizer.encode("LONG")
    r = client.completions.create(model="scripted", prompt=ids)
    assert r.choices[0].text == "abcdefghijklmnop" and r.usage.prompt_tokens == len(ids)
    chunks = list(
        client.completions.create(model="scripted", prompt=ids, max_tokens=3, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- bad input


def test_errors_surface_as_the_sdks_exceptions(scripted):
    client = scripted.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (openai.BadRequestError, "messages", dict(messages=[])),
        (openai.BadRequestError, "temperature", dict(messages=user, temperature="hot")),
        (
            openai.BadRequestError,
            "messages.0.role",
            dict(messages=[{"role": "bot", "content": "x"}]),
        ),
        (openai.BadRequestError, "max_tokens", dict(messages=user, max_tokens=10**6)),
        (openai.BadRequestError, "top_logprobs", dict(messages=user, top_logprobs=3)),
        (
            openai.BadRequestError,
            "tool_choice",
            dict(
                messages=user,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "mul"}},
            ),
        ),  # fmt: skip
        (openai.BadRequestError, "tool_choice", dict(messages=user, tool_choice="required")),
        (openai.BadRequestError, "stop", dict(messages=user, stop=["a", "b", "c", "d", "e"])),
        (openai.BadRequestError, "frequency_penalty", dict(messages=user, frequency_penalty=1)),
        (openai.BadRequestError, "bogus", dict(messages=user, extra_body={"bogus": 1})),
        (openai.NotFoundError, "model", dict(messages=user, model="gpt-4o")),
    ]
    for error, param, kw in cases:
        kw.setdefault("model", "scripted")
        with pytest.raises(error) as e:
            client.chat.completions.create(**kw)
        body = e.value.body
        assert set(body) == {"message", "type", "param", "code"}, body
        assert body["param"] == param, (param, body)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="scripted", prompt="x" * 2048, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="scripted", prompt=[10**6])
    with pytest.raises(openai.AuthenticationError):
        scripted.client(key="wrong").models.list()
    # Any max_tokens that fits the context is served.
    prompt = "LONG " + "x" * 2000
    r = scripted.client().completions.create(
        model="scripted", prompt=prompt, max_tokens=2048 - len(prompt)
    )
    assert r.usage.completion_tokens == 2048 - len(prompt)


def test_a_full_queue_is_429_with_retry_after(scripted):
    backend = scripted.backend
    backend.release.clear()
    try:
        with concurrent_calls(5) as pool:  # 4 on the slots, 1 waiting
            held = [pool.submit(chat, scripted, "HOLD") for _ in range(5)]
            deadline = time.monotonic() + WAIT_S
            while (backend.stats()["slots_busy"], backend.stats()["queue_length"]) != (4, 1):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            backend.max_queue = 1
            with pytest.raises(openai.RateLimitError) as e:
                chat(scripted, "hi")
            assert e.value.response.headers["retry-after"] == "1"
            assert e.value.body["type"] == "rate_limit_error"
            backend.release.set()
            assert all(f.result(WAIT_S).choices[0].finish_reason == "stop" for f in held)
    finally:
        backend.max_queue = 64
        backend.release.set()
    assert chat(scripted, "hi").choices[0].finish_reason == "stop"  # still serving


def concurrent_calls(n: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(n, thread_name_prefix="test-client")


def test_malformed_and_oversize_bodies(scripted):
    cases = [
        (b'{"model": "scripted", "messages": [', 400, None),
        (b"\xff\xfe not utf-8", 400, None),
        (b"[1, 2, 3]", 400, None),
        (b"[" * 5000 + b"]" * 5000, 400, None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
        (b'{"model": "scripted", "messages": [{"role": "user"}]}', 400, "messages.0.content"),
        (b'{"model": "scripted", "messages": "hi"}', 400, "messages"),
        (
            b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 0}',
            400,
            "n",
        ),
        (
            json.dumps(
                {"model": "scripted", "messages": [{"role": "user", "content": "x" * 70_000}]}
            ).encode(),
            413,
            None,
        ),
    ]
    for body, status, param in cases:
        got, error, _ = raw(scripted, body)
        assert got == status, (body[:60], got, error)
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["param"] == param, (body[:60], error)
    lone_surrogate = b'{"model": "scripted", "prompt": "\\ud800"}'
    assert raw(scripted, lone_surrogate, "/v1/completions")[0] == 400
    status, error, _ = raw(scripted, b"", "/v1/nowhere", method="GET")
    assert status == 404 and error["error"]["type"] == "not_found_error"
    status, error, _ = raw(scripted, b"", "/v1/chat/completions", method="GET")
    assert status == 405 and "message" in error["error"]
    for authorization in ("Basic abc", None):
        status, error, headers = raw(scripted, b"{}", headers={"Authorization": authorization})
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert error["error"]["type"] == "authentication_error"
    assert chat(scripted, "hi").choices[0].finish_reason == "stop"  # still serving


def test_a_client_gone_mid_stream_frees_its_slots(scripted):
    """The stream's task is cancelled when the connection closes: its choices are cancelled
    at once, not when they would have ended."""
    backend = scripted.backend
    before = len(backend.cancelled)
    for stream in (True, False):
        with socket.create_connection(("127.0.0.1", scripted.port), timeout=WAIT_S) as sock:
            body = json.dumps(
                {
                    "model": "scripted",
                    "max_tokens": 2000,
                    "n": 2,
                    "stream": stream,
                    "messages": [{"role": "user", "content": "LONG"}],
                }
            ).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + WAIT_S
            while backend.stats()["slots_busy"] < 2:  # both choices decode
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if stream:
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert wait_idle(backend, timeout=10)["slots_busy"] == 0
        assert time.monotonic() - started < 2  # 2,000 tokens would take 4 s at the least
    assert len(backend.cancelled) == before + 4


def test_a_checkpoint_without_a_chat_template_serves_text_completions():
    from jaxrl_scale.models.tokenizer import CharTokenizer
    from jaxrl_scale.serve.app import make_app

    char = CharTokenizer("abcdefghijklmnopqrstuvwxyzLONG ")
    backend = Scripted(char)
    server = Server(make_app(backend, char), backend)
    try:
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            chat(server, "hi")
        with pytest.raises(openai.BadRequestError, match="alphabet"):
            client.completions.create(model="scripted", prompt="LONG 1+1")
        r = client.completions.create(model="scripted", prompt="LONG", max_tokens=3)
        assert r.choices[0].text == "abc"
    finally:
        server.close()
        backend.close()


# --------------------------------------------------------------------------- telemetry


def test_metrics_and_a_log_line_per_request(scripted, caplog):
    with caplog.at_level("INFO", logger="jaxrl_scale.serve"):
        r = chat(scripted, "hi")
        with pytest.raises(openai.NotFoundError):
            scripted.client().chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}]
            )
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "jaxrl_scale.serve"]
    mine = [line for line in lines if line.startswith(r.id)]
    assert len(mine) == 1, lines
    assert re.search(r" 200 prompt=\d+ completion=\d+ ttft=[\d.]+s [\d.]+s", mine[0]), mine
    assert any(" 404 " in line for line in lines), lines
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", scripted.port, timeout=WAIT_S)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for name in (
        "jaxrl_serve_queue_length",
        "jaxrl_serve_slots_busy",
        "jaxrl_serve_slots 4.0",
        "jaxrl_serve_slot_occupancy",
        "jaxrl_serve_prompt_tokens_total",
        "jaxrl_serve_generated_tokens_total",
        "jaxrl_serve_time_to_first_token_seconds_count",
        "jaxrl_serve_tokens_per_second_count",
        "jaxrl_serve_request_seconds_count",
        'jaxrl_serve_requests_total{endpoint="/v1/chat/completions",status="200"}',
        'jaxrl_serve_requests_total{endpoint="/v1/chat/completions",status="404"}',
    ):
        assert name in text, name


# --------------------------------------------------------------------------- load


async def _load(server: Server) -> dict[str, int]:
    """32 clients at once: 10 whole chats, 8 streamed, 6 that go away after the first chunk,
    4 text completions, 4 that send garbage. Returns what each kind got."""
    model = server.backend.model_name
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S
    )

    def messages(i: int, what: str = "hi") -> list[dict]:
        return [{"role": "user", "content": f"{what} {i}"}]

    async def whole(i):
        r = await client.chat.completions.create(
            model=model, messages=messages(i), max_tokens=8, temperature=0.5, seed=i
        )
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens
        return "whole"

    async def streamed(i):
        stream = await client.chat.completions.create(
            model=model,
            messages=messages(i),
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage.completion_tokens >= 1
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        return "streamed"

    async def gone(i):
        stream = await client.chat.completions.create(
            model=model, messages=messages(i, "LONG"), max_tokens=400, stream=True
        )
        async for _ in stream:
            break
        await stream.close()
        return "gone"

    async def completion(i):
        r = await client.completions.create(model=model, prompt=f"x {i}", max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        return "completion"

    async def garbage(i):
        body = [
            b'{"model": ',
            b'{"model": "x", "messages": []}',
            b"\x00" * 100,
            b'{"model": "%s", "prompt": "hi", "max_tokens": -1}' % model.encode(),
        ][i % 4]
        path = b"/v1/completions" if i % 4 == 3 else b"/v1/chat/completions"
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path, KEY.encode(), len(body), body)
        )
        await writer.drain()
        status = await reader.readline()
        writer.close()
        await writer.wait_closed()
        assert status.split()[1] in (b"400", b"404"), status
        return "garbage"

    kinds = [whole] * 10 + [streamed] * 8 + [gone] * 6 + [completion] * 4 + [garbage] * 4
    results = await asyncio.wait_for(
        asyncio.gather(*(kind(i) for i, kind in enumerate(kinds)), return_exceptions=True),
        timeout=4 * WAIT_S,
    )
    await client.close()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return {k: results.count(k) for k in set(results)}


@pytest.mark.parametrize("which", ["scripted", "engine", "remote"])
def test_load_every_request_answered_nothing_leaked(which, request):
    server = request.getfixturevalue(which)
    chat(server, "warm up", max_tokens=2)
    threads = threading.active_count()
    gc.collect()  # (what earlier tests' servers left: not this test's requests)
    before = {id(o) for o in gc.get_objects() if isinstance(o, (Generation, ChoiceText))}
    got = asyncio.run(_load(server))
    assert got == {"whole": 10, "streamed": 8, "gone": 6, "completion": 4, "garbage": 4}
    assert wait_idle(server.backend) == {"queue_length": 0, "slots": 4, "slots_busy": 0}
    deadline = time.monotonic() + WAIT_S
    state = server.server.server_state
    while state.tasks or state.connections or threading.active_count() > threads:
        assert time.monotonic() < deadline, (state.tasks, threading.enumerate())
        time.sleep(0.05)
    # Memory: no request's objects outlive it (generations, their texts, the engine's rows).
    gc.collect()
    alive = [o for o in gc.get_objects()
             if isinstance(o, (Generation, ChoiceText)) and id(o) not in before]  # fmt: skip
    assert not alive, [
        (o, getattr(o, "_loop", None), getattr(o, "request", None)) for o in alive[:3]
    ]
    if which in ("engine", "remote"):
        backend = server.engine if which == "remote" else server.backend
        engine = backend.engine
        assert not (engine.prompts or engine.waiting or backend._choices)
    assert chat(server, "hi", max_tokens=2).choices[0].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------- the engine


def test_engine_chat_exact_ids_and_logprobs(engine):
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = engine.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert r.model_extra["prompt_token_ids"] == tok.encode(tok.apply_chat_template(messages))
    assert len(ids) == r.usage.completion_tokens == len(choice.logprobs.content)
    assert choice.finish_reason in ("stop", "length")
    assert (ids[-1] in tok.eos_ids) == (choice.finish_reason == "stop")
    for token, entry in zip(ids, choice.logprobs.content, strict=True):
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert entry.token == tok.decode([token], skip_special_tokens=False)
        assert entry.token == top[0].token and entry.logprob == pytest.approx(top[0].logprob)
    text = tok.decode(ids)
    if not any(marker in text for marker in ADDED):
        assert choice.message.content == text
    # The same greedy request gives the same tokens.
    again = engine.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert again.choices[0].model_extra["token_ids"] == ids


def test_engine_seeded_sampling_same_streamed_or_not(engine):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=11,
        n=2,
        extra_body={"return_token_ids": True},
    )
    client = engine.client()
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, **kw)
    streamed = {0: [], 1: []}
    for c in stream:
        for choice in c.choices:
            streamed[choice.index] += choice.model_extra.get("token_ids") or []
    for i in (0, 1):
        assert streamed[i] == whole.choices[i].model_extra["token_ids"]
    assert streamed[0] != streamed[1]  # each choice its own draw


def test_engine_completions_tools_and_context(engine):
    client, tok = engine.client(), engine.tokenizer
    ids = tok.encode("Once upon a time")
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == ids
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens <= 5
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=ids, max_tokens=1024 - len(ids) + 1)
    r = chat(engine, "add 1 and 2", tools=TOOLS, max_tokens=6)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 300  # the template wrote the tools into the prompt


# --------------------------------------------------------------------------- the command


def test_cli_refuses_a_remote_bind_without_a_key(checkpoint, capsys, monkeypatch):
    from jaxrl_scale.cli import main
    from jaxrl_scale.serve.server import check_exposure

    monkeypatch.delenv("JAXRL_API_KEY", raising=False)
    assert main(["serve", "--init-from", str(checkpoint), "--host", "0.0.0.0"]) == 2
    assert "--allow-remote-without-key" in capsys.readouterr().err
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_exposure(host, None, False)
    check_exposure("0.0.0.0", "key", False)
    check_exposure("10.0.0.5", None, True)
    with pytest.raises(ValueError, match="API key"):
        check_exposure("example.org", None, False)


def test_cli_serves_a_checkpoint_until_sigterm(checkpoint):
    """`jaxrl-scale serve --init-from`: answers the SDK, and exits 0 within 15 s of SIGTERM
    while a stream is open."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAXRL_API_KEY": KEY}
    command = [
        sys.executable,
        "-m",
        "jaxrl_scale.cli",
        "serve",
        "--init-from",
        str(checkpoint),
        "--port",
        "0",
        "--slots",
        "2",
        "--context",
        "512",
        "--served-model-name",
        "tiny",
    ]
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        deadline = time.monotonic() + 3 * WAIT_S
        while not (m := re.search(r"serving on (http://127\.0\.0\.1:\d+)/v1", "".join(lines))):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(proc.stdout.readline())
        base = m.group(1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
        r = client.chat.completions.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.usage.completion_tokens >= 1 and r.model == "tiny"
        # seed 2 samples 436 tokens before its end-of-turn on this checkpoint: the stream is
        # still decoding when the signal comes (unseeded, the random policy may stop at once)
        stream = client.chat.completions.create(
            model="tiny", max_tokens=400, seed=2, stream=True,
            messages=[{"role": "user", "content": "hi"}],
        )  # fmt: skip
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        assert next(chunks).choices[0].finish_reason is None  # decoding when the signal comes
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
        lines.append(rest)
        assert time.monotonic() - started < 15, "".join(lines)
        assert proc.returncode == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=WAIT_S)


def test_engine_log_probs_outside_the_nucleus_stay_json(engine):
    """top_p keeps a few tokens: the other alternatives' log-probs are -inf in the engine,
    which JSON cannot carry; they come back at a floor, whole and streamed."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
              temperature=1.0, top_p=0.01, seed=3, logprobs=True, top_logprobs=20)  # fmt: skip
    client = engine.client()
    whole = client.chat.completions.create(**kw)
    tops = [t.logprob for c in whole.choices[0].logprobs.content for t in c.top_logprobs]
    assert len(tops) == 20 * len(whole.choices[0].logprobs.content)
    assert min(tops) == -9999.0 and max(tops) <= 0  # some were outside the nucleus
    streamed = [
        t.logprob
        for chunk in client.chat.completions.create(stream=True, **kw)
        for choice in chunk.choices
        for c in (choice.logprobs.content if choice.logprobs else [])
        for t in c.top_logprobs
    ]
    assert streamed == tops


def test_engine_log_prob_bytes_are_each_tokens_own(engine):
    """A byte-level token may be part of one UTF-8 character: its text alone is U+FFFD, its
    `bytes` are its own, and the choice's bytes joined are its text."""
    r = engine.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=24,
        temperature=1.0, seed=5, logprobs=True,
    )  # fmt: skip
    tokens = r.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in tokens).decode(errors="replace")
    text = r.choices[0].message.content or ""
    if r.choices[0].finish_reason == "stop":  # the end-of-turn token: its text, not content
        joined = joined[: -len(tokens[-1].token)]
    assert joined == text
    assert any(t.token == "\ufffd" and len(t.bytes) == 1 for t in tokens)  # a partial one


# --------------------------------------------------------------------------- detokenizing


def test_streamed_text_is_the_whole_decode_and_garbage_bytes_cost_a_short_window(tokenizer):
    """Token by token, text with multi-byte characters comes out as the whole decode; bytes
    that never complete a character (a random model's) come out as U+FFFD without the
    decoding window growing with them (else each token costs its whole completion)."""
    text = "naïve café: 漢字 and 🙂🙂, done."
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # byte tokens: characters span several
    choice = ChoiceText(tokenizer)
    for t in ids:
        choice.add(Delta(0, (t,), (-1.0,)))
    choice.add(Delta(0, (), (), finish="length"))
    assert choice.text == text == tokenizer.decode(ids)

    windows = []

    class Counting:
        def decode(self, ids, **kw):
            windows.append(len(ids))
            return tokenizer.decode(ids, **kw)

    rng = np.random.default_rng(0)
    # U+0080..U+00BF are the bytes C2 xx: their second tokens are the continuation bytes
    garbage = [tokenizer.encode(chr(b))[1] for b in range(0x80, 0xC0)]
    ids = [garbage[k] for k in rng.integers(0, 64, 400)]  # continuation bytes alone
    ids[100:104] = tokenizer.encode("🙂")  # a whole character inside the garbage
    choice = ChoiceText(Counting())
    for t in ids:
        choice.add(Delta(0, (t,), (-1.0,)))
    choice.add(Delta(0, (), (), finish="length"))
    assert max(windows) <= 8
    assert choice.text.replace("\ufffd", "") == "🙂"
    assert choice.text.count("\ufffd") == tokenizer.decode(ids).count("\ufffd")


def test_a_byte_level_tokenizer_streams_its_decode_whatever_the_ids():
    """Byte-level (Qwen3's vocabulary, and added tokens that mix characters of the byte
    alphabet with others, which the decoder reads as their own UTF-8): random ids (bytes
    that form no character, special and added tokens, whole characters) in deltas of random
    sizes come out as the tokenizer's own decode of them; each token's offset is where its
    text starts, and its bytes are the ones `decode` reads."""
    tokenizer = qwen3_tokenizer()
    extra = ["日Ġé", "für ", "🙂x"]
    tokenizer.backend.add_tokens([tokenizers.AddedToken(t, special=False) for t in extra])
    tokenizer.backend.add_special_tokens(["<|extra|>"])
    assert tokenizer.byte_level and tokenizer.decode(tokenizer.encode("für ")) == "für "
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = rng.integers(0, tokenizer.vocab_size, rng.integers(1, 40)).tolist()
        choice = ChoiceText(tokenizer)
        at = 0
        while at < len(ids):
            k = int(rng.integers(1, 6))
            part = ids[at : at + k]
            at += k
            done = "length" if at >= len(ids) else None
            choice.add(Delta(0, tuple(part), (-1.0,) * len(part), finish=done))
        assert choice.text == tokenizer.decode(ids)
        assert choice.offsets == sorted(choice.offsets) and len(choice.offsets) == len(ids)
        for skip in (True, False):
            raw = b"".join(tokenizer.token_bytes(t, skip_special_tokens=skip) for t in ids)
            assert raw.decode("utf-8", "replace") == tokenizer.decode(ids, skip_special_tokens=skip)


# --------------------------------------------------------------------------- the split server


def test_the_split_server_answers_as_the_engine_does(engine, remote):
    """Through the relay and its sockets: the same seeded tokens, log-probs and ids as the
    in-process server, streamed or not; a request over the context or with top_logprobs
    out of range is a 400; past the queue, a 429 with Retry-After."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=12, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2,
              extra_body={"return_token_ids": True})  # fmt: skip
    here = engine.client().chat.completions.create(**kw)
    there = remote.client().chat.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in there.choices] == [
        c.model_extra["token_ids"] for c in here.choices
    ]
    assert [[t.logprob for t in c.logprobs.content] for c in there.choices] == [
        [t.logprob for t in c.logprobs.content] for c in here.choices
    ]
    streamed = [chunk for chunk in remote.client().chat.completions.create(stream=True, **kw)]
    text = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert [text[0], text[1]] == [c.message.content for c in there.choices]
    with pytest.raises(openai.BadRequestError, match="context"):
        remote.client().completions.create(model="tiny", prompt="hi", max_tokens=2000)
    # Four long requests hold the four slots and two wait: with room for two waiting, the
    # next is refused with a 429.
    client = remote.client()
    remote.backend.max_queue = 2
    streams = [client.completions.create(model="tiny", prompt=[1] * 8, max_tokens=600,
                                         seed=i, stream=True) for i in range(6)]  # fmt: skip
    try:
        assert all(next(iter(s)).choices for s in streams[:4])  # four decoding
        waited = time.monotonic() + WAIT_S
        while remote.backend.stats()["queue_length"] < 2:
            assert time.monotonic() < waited, remote.backend.stats()
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert refused.value.response.headers["retry-after"]
    finally:
        remote.backend.max_queue = 64
        for s in streams:
            s.close()
    assert wait_idle(remote.backend)["slots_busy"] == 0


def _served(checkpoint, *extra: str):
    """`jaxrl-scale serve` on `checkpoint` (a free port), and its base URL once it serves."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    command = [sys.executable, "-m", "jaxrl_scale.cli", "serve", "--init-from", str(checkpoint),
               "--port", "0", "--slots", "2", "--context", "256", "--served-model-name", "tiny",
               "--no-warm-up", *extra]  # fmt: skip
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, deadline = [], time.monotonic() + 3 * WAIT_S
    while not (m := re.search(r"serving on (http://127\.0\.0\.1:\d+)/v1", "".join(lines))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("".join(lines) + proc.stdout.read())
        lines.append(proc.stdout.readline())
    return proc, m.group(1)


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` has exited (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_side_of_the_split_server_takes_the_other_down(checkpoint):
    """SIGKILL the engine's process: its HTTP process fails what is open and exits within
    seconds (no server left answering for a dead engine); SIGKILL the HTTP process: the
    engine's process exits non-zero, saying so."""
    proc, base = _served(checkpoint)
    front = None
    try:
        (front,) = _children(proc.pid)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        stream = client.completions.create(model="tiny", prompt=[1] * 8, max_tokens=200,
                                           seed=2, stream=True)  # fmt: skip
        assert next(iter(stream)).choices
        proc.kill()
        proc.wait(WAIT_S)
        assert _gone(front, 15), "the HTTP process outlived its engine"
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:  # the open stream ends with an error, not a hang
                pass
    finally:
        for pid in (proc.pid, front):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=WAIT_S)

    # The HTTP process killed while streams decode: the engine's thread is sending to a
    # socket no one reads any more, and the command still ends, saying why.
    proc, base = _served(checkpoint, "--context", "4096")
    try:
        (front,) = _children(proc.pid)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        streams = [client.completions.create(model="tiny", prompt=[1] * 8, max_tokens=4000,
                                             seed=2, stream=True) for _ in range(2)]  # fmt: skip
        for stream in streams:
            chunks = iter(stream)
            assert next(chunks).choices and next(chunks).choices[0].finish_reason is None
        os.kill(front, signal.SIGKILL)
        out, _ = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1, out[-2000:]
        assert "the HTTP server's process exited with status -9" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=WAIT_S)


def test_a_port_in_use_ends_the_command_with_the_reason(checkpoint):
    """The HTTP process cannot bind: the command exits 1 with the bind error, not a hang."""
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    command = [sys.executable, "-m", "jaxrl_scale.cli", "serve", "--init-from", str(checkpoint),
               "--port", str(port), "--slots", "2", "--context", "256", "--no-warm-up"]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=3 * WAIT_S)  # fmt: skip
    finally:
        taken.close()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-2000:]
    assert "Address already in use" in out and "the HTTP server's process exited" in out
