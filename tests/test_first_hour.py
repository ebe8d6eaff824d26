"""A new user's first hour: impossible configs are refused at setup, in seconds, naming the
keys (a run the memory plan says does not fit, episodes that need a chat template the
tokenizer lacks); a tokenizer that turns the prompts into padding is warned about with the
share; a run says what it is doing from its first seconds, as plain lines or a bar."""

import warnings

import pytest
from conftest import FAST, TINY_CONFIG

from jaxrl_scale.config import load_config
from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.memory.check import pool_bytes
from jaxrl_scale.models.hf import load_tokenizer, resolve_checkpoint
from jaxrl_scale.models.tokenizer import CharTokenizer
from jaxrl_scale.train import setup

# 1024 rows of 516 tokens against a 151,936-token vocabulary on one device: the train step's
# logits chunks alone are 1024 x 256 x 151,936 x 4 bytes = 148 GiB.
TOO_BIG = [*FAST, "model.vocab_size=151936", "train.prompts_per_step=64", "train.group_size=16",
           "sampler.max_new_tokens=512"]  # fmt: skip


def test_a_run_that_does_not_fit_is_refused_at_setup_with_the_plans_numbers(tmp_path):
    pool, where = pool_bytes(1)
    assert pool > 0 and "host memory available" in where  # the CPU's: shared by its devices
    with pytest.raises(ConfigError) as refused:
        setup(load_config(TINY_CONFIG, TOO_BIG), tmp_path)
    message = str(refused.value)
    assert "does not fit its devices" in message and "sequences of 516 tokens" in message
    train_line = next(line for line in message.splitlines() if "train step:" in line)
    per_device = float(train_line.split("train step: ")[1].split(" GiB")[0])
    assert per_device > 148  # the plan's number, at least the logits chunks worked out above
    assert "train.micro_batches" in train_line  # what to change, named by its key
    assert "train.check_memory: false" in message
    assert not (tmp_path / "config.yaml").exists()  # refused before the run wrote anything
    # The check can be turned off (the run is then the user's call).
    run = setup(load_config(TINY_CONFIG, [*TOO_BIG, "train.check_memory=false"]), tmp_path)
    run.checkpointer.close()
    assert (tmp_path / "config.yaml").exists()


class Prompts:
    """A task object with the given prompts, scored 0."""

    def __init__(self, prompts, tokenizer=None):
        self.train_examples = [{"prompt": p} for p in prompts]
        self.eval_examples = self.train_examples[:4]
        if tokenizer is not None:
            self.tokenizer = tokenizer

    def score(self, completion, example):
        return 0.0


def test_a_tokenizer_that_turns_prompts_into_padding_is_warned_with_the_share(tmp_path):
    # The demo policy's tokenizer knows one token per character of arithmetic (digits, + - *
    # =, space): letters become <pad>.
    cfg = load_config(TINY_CONFIG, [*FAST, "model.init_from=asset:demo_policy"])
    words = Prompts([f"What is {i} plus {i + 1}? Answer: {i}+{i + 1}=" for i in range(8)])
    with pytest.warns(UserWarning, match=r"turns (\d+)% of the prompts' tokens") as caught:
        setup(cfg, tmp_path / "words", task=words).checkpointer.close()
    message = str(next(w.message for w in caught if "prompts' tokens" in str(w.message)))
    share = int(message.split("turns ")[1].split("%")[0])
    prompt = words.train_examples[0]["prompt"]
    vocab = load_tokenizer(resolve_checkpoint("asset:demo_policy")).backend.get_vocab()
    unknown = sum(ch not in vocab for ch in prompt)  # one token per character
    assert share == round(100 * unknown / len(prompt))
    assert "'<pad>'" in message and "model.init_from" in message
    sums = Prompts([f"{i}+{i + 1}=" for i in range(8)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the task's own text: no warning
        setup(cfg, tmp_path / "sums", task=sums).checkpointer.close()


class ChatGame:
    """A multi-turn task whose environments speak in chat messages."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.train_examples = [{"n": i} for i in range(8)]
        self.eval_examples = self.train_examples[:4]

    def make_env(self, example):
        return ChatEnv()


class ChatEnv:
    def reset(self):
        return [{"role": "user", "content": "Guess my number."}]

    def step(self, action):
        return None, 0.0, True


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Tools(Prompts):
    tools = [add]


def test_episodes_that_need_a_chat_template_are_refused_at_setup(tmp_path):
    cfg = load_config(TINY_CONFIG, [*FAST, "task.max_turns=2", "task.max_episode_tokens=32"])
    tok = CharTokenizer("0123456789+-= ")  # no chat template
    with pytest.raises(ConfigError, match="first observation is chat messages, but the "
                                          "tokenizer has no chat template"):  # fmt: skip
        setup(cfg, tmp_path / "chat", task=ChatGame(tok))
    with pytest.raises(ConfigError, match="a tool task's episodes are chat conversations"):
        setup(cfg, tmp_path / "tools", task=Tools(["1+1="] * 8, tokenizer=tok))


def _train_output(tmp_path, monkeypatch, *, tty: bool) -> str:
    """What a 4-step run prints on stdout: a pseudo-terminal's, or a pipe's (drained by a
    thread as it is written: either blocks its writer once its buffer is full)."""
    import io
    import os
    import select
    import threading

    from jaxrl_scale.train import train

    master, slave = os.openpty() if tty else os.pipe()
    chunks: list[bytes] = []

    done = threading.Event()

    def drain():  # until the run is over and nothing is left to read (the run's forked
        # workers hold the writing end open, so no end of file comes)
        while True:
            if not select.select([master], [], [], 0.2)[0]:
                if done.is_set():
                    return
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # a pseudo-terminal's master reads EIO once the slave is closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stream = io.TextIOWrapper(os.fdopen(slave, "wb"), write_through=True)
    assert stream.isatty() == tty
    monkeypatch.setattr("sys.stdout", stream)
    try:
        cfg = load_config(TINY_CONFIG, [*FAST, "train.steps=4", "train.eval_every=2"])
        train(cfg, tmp_path / ("tty" if tty else "pipe"))
    finally:
        stream.close()
        done.set()
        reader.join(timeout=30)
        os.close(master)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_run_says_what_it_does_from_its_first_seconds(tmp_path, monkeypatch):
    import re

    out = _train_output(tmp_path, monkeypatch, tty=False)
    lines = out.splitlines()
    # Setup and compilation phases come first, before any step.
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    phases = "\n".join(lines[:first_step])
    for phase in ("setup: a qwen2 policy from seed 0", "setup: task arithmetic: 64 training",
                  "evaluating the starting policy: 8 held-out prompts x 2 samples",
                  "training: steps 1-4"):  # fmt: skip
        assert phase in phases, out
    steps = [line for line in lines if line.startswith("step ")]
    pattern = r"step (\d)/4  (\S+) samples/s  reward \d\.\d{3}  staleness \d+  ETA (\S+)"
    parsed = [re.match(pattern, line) for line in steps]
    assert all(parsed), steps
    assert [int(m.group(1)) for m in parsed][-1] == 4 and "\r" not in out  # plain lines
    assert all(float(m.group(2)) > 0 for m in parsed[1:])  # a rate once a step has passed
    assert sum("eval " in line for line in steps) == 2  # steps 2 and 4 evaluate
    assert "warning" not in out.lower()


def test_on_a_terminal_the_steps_are_a_bar_redrawn_in_place(tmp_path, monkeypatch):
    out = _train_output(tmp_path, monkeypatch, tty=True)
    bars = [part for part in out.split("\r") if part.startswith("[")]
    assert [b.split("] step ")[1].split("/")[0] for b in bars] == ["1", "2", "3", "4"]
    assert bars[-1].startswith("[" + "#" * 20 + "]")  # 4 of 4: full
    assert bars[0].startswith("[#####.....")  # 1 of 4: a quarter
