"""Agent tasks (rl/agents.py): the user's agent, an OpenAI-SDK program, trained through its
session URL on the trainer's own slot engine; failures counted, the run going on."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
from conftest import FIXTURES, HF_FIXTURES, ROOT, TINY_CONFIG

from jaxrl_scale.config import load_config
from jaxrl_scale.train import train

RUN = [
    "task.num_train=8", "task.num_eval=4", "task.max_episode_tokens=160",
    "task.agent_timeout=60", "train.prompts_per_step=2", "train.group_size=2",
    "train.steps=2", "train.eval_every=2", "train.eval_samples=1", "warm_start.steps=0",
    "sampler.batching=continuous", "sampler.interruption=null", "sampler.slots=4",
    "checkpoint.every=0", "mesh.data=1", "pipeline.mode=sync", "forecast.every=0",
]  # fmt: skip


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """The tiny Qwen2 checkpoint with the published Qwen2.5 chat template."""
    folder = tmp_path_factory.mktemp("instruct")
    for f in (HF_FIXTURES / "qwen2").iterdir():
        shutil.copy(f, folder / f.name)
    shutil.copy(FIXTURES / "chat_templates" / "qwen2.5.jinja", folder / "chat_template.jinja")
    return folder


class Sums:
    """An agent task: add two numbers with a calculator tool, in two calls (the second after
    the tool's answer); examples may ask the agent to fail or to hang."""

    def __init__(self, bad: dict | None = None, compact: bool = False):
        # One of each example's two episodes sends its second call a compacted history (a
        # new branch) and is rewarded 1, its sibling 0 (every group is kept).
        self.compact, self.compacted = compact, set()  # the compacted sessions' URLs
        self._lock = threading.Lock()  # the agents' threads count each example's episodes
        self._episodes: dict[tuple, int] = {}
        rng = np.random.default_rng(0)
        rows = [{"a": int(a), "b": int(b)} for a, b in rng.integers(0, 50, (12, 2))]
        for i, what in (bad or {}).items():
            rows[i] = {**rows[i], what: True}
        self.train_examples, self.eval_examples = rows[:8], rows[8:]
        self.calls: list[dict] = []  # what the agent saw (the agents' threads append)
        self.plain: list[str] = []  # /v1 of the same server, without the session

    def agent(self, base_url, api_key, example):
        if example.get("raise"):
            raise RuntimeError("the agent's own bug")
        if example.get("garbage"):
            return "yes"  # not a number
        if example.get("hang"):
            time.sleep(8)
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        plain = openai.OpenAI(base_url=base_url.split("/sessions/")[0] + "/v1", api_key=api_key,
                              max_retries=0)  # fmt: skip
        try:
            plain.models.list()
            self.plain.append("served")
        except openai.AuthenticationError:
            self.plain.append("refused")
        tools = [{"type": "function", "function": {
            "name": "add", "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
        messages = [{"role": "user", "content": f"What is {example['a']} + {example['b']}?"}]
        first = client.chat.completions.create(
            model="policy", messages=messages, tools=tools, max_tokens=8, temperature=0.3,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        reply = first.choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "user", "content": str(example["a"] + example["b"])}]  # fmt: skip
        with self._lock:
            key = (example["a"], example["b"])
            self._episodes[key] = self._episodes.get(key, 0) + 1
            compact = self.compact and self._episodes[key] % 2 == 0
        if compact:  # a summary in place of the history, unlike any sibling's
            note = f"Earlier (note {secrets.token_hex(3)}): asked {example['a']} + {example['b']}."
            messages = [{"role": "system", "content": note}, messages[-1]]
            self.compacted.add(base_url)
        second = client.chat.completions.create(
            model="policy", messages=messages, tools=tools, max_tokens=8,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        self.calls.append({"url": base_url, "first": first, "second": second})
        if self.compact:
            return float(compact)
        return float(str(example["a"] + example["b"]) in (second.choices[0].message.content or ""))


def test_an_sdk_agent_trains_through_its_session_urls(instruct, tmp_path):
    task = Sums(compact=True)
    # pipeline_rl, k = 1: the batch ahead opens its sessions while this one runs, its calls
    # held for the next version; this batch's later calls must not wait behind them.
    overrides = [*RUN, f"model.init_from={instruct}", "log.rollouts=3",
                 "pipeline.mode=pipeline_rl", "pipeline.max_staleness=1"]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path / "run", task=task)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    for r in rows[1:]:
        assert r["agent_calls_mean"] == 2 and r["agent_errors"] == 0 == r["agent_timeouts"]
        # Half the episodes compacted their history: a second branch, trained with its
        # group all the same (the group's prompt is what its samples share).
        assert r["agent_branches"] == 2 and r["episodes_trained"] == 4 and r["gen_tokens"] > 0
        assert r["episodes_prompt_mismatch"] == 0
        assert r["agent_branches_trained"] == 2  # their first branches, packed beside them
        assert r["agent_branches_left"] == 0
    assert "eval_pass_rate" in rows[-1] and "eval_pass_rate" in rows[0]
    assert max(r["staleness_max"] for r in rows) <= 1
    assert task.plain and set(task.plain) == {"refused"}  # /v1 without a session
    from test_metrics import _documented_keys

    agent_keys = {k for r in rows for k in r if k.startswith("agent_")}
    assert len(agent_keys) == 8 and agent_keys <= _documented_keys()
    urls = [c["url"] for c in task.calls]
    assert len(set(urls)) == len(urls) and all("/sessions/" in u for u in urls)
    seen = {}  # session -> (the ids its second call consumed and sampled, both replies)
    for c in task.calls:  # token in, token out: the second call extends the first's ids
        first, second = c["first"], c["second"]
        kept = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        reply = second.choices[0].model_extra["token_ids"]
        sid = c["url"].split("/sessions/")[1].split("/")[0]
        if c["url"] in task.compacted:  # rendered whole: the second branch, its reply alone
            assert second.model_extra["prompt_token_ids"][: len(kept)] != kept
            seen[sid] = (second.model_extra["prompt_token_ids"] + reply, reply, 1)
            seen[sid, 0] = (kept, first.choices[0].model_extra["token_ids"], 0)  # its first
            continue
        assert second.model_extra["prompt_token_ids"][: len(kept)] == kept
        replies = first.choices[0].model_extra["token_ids"] + reply
        seen[sid] = (second.model_extra["prompt_token_ids"] + reply, replies, 0)
    # rollouts.jsonl: the trained sequence is exactly the ids the agent's calls consumed and
    # sampled, the sampled ones (both replies) masked 1.
    samples = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    for s in samples:
        first_of_two = (s["session"], 0) in seen and s["branch"] == 0
        ids, replies, branch = seen[(s["session"], 0) if first_of_two else s["session"]]
        assert s["tokens"] == ids and len(s["mask"]) == len(ids) == len(s["logp"])
        assert [t for t, m in zip(s["tokens"], s["mask"], strict=True) if m] == replies
        assert s["branch"] == branch
        assert len(s["calls"]) == (1 if first_of_two or branch else 2)
        assert s["reward"] in (0.0, 1.0) and isinstance(s["advantage"], float)
        assert all(v >= 0 for v, m in zip(s["versions"], s["mask"], strict=True) if m)


def test_agents_that_raise_hang_or_return_garbage_are_counted_and_dropped(instruct, tmp_path):
    # 6 of the 8 training examples fail: a step's 2 draw at least one of them.
    task = Sums(bad={0: "raise", 1: "hang", 2: "garbage", 3: "hang", 4: "raise", 5: "hang"})
    overrides = [*RUN, f"model.init_from={instruct}", "task.agent_timeout=3", "train.steps=1",
                 "train.eval_every=0"]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path / "run", task=task)
    (row,) = [r for r in rows if r["step"] == 1]
    failed = row["agent_errors"] + row["agent_timeouts"]
    assert failed in (2, 4)  # each example's 2 episodes fail alike
    assert row["episodes_trained"] == 4 - failed


def react(base_url, api_key, example):
    """A LangGraph ReAct agent (langchain-openai's ChatOpenAI) with a calculator, as its
    framework's users write it; a second question goes on from the first's history."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_tokens=8,
                     max_retries=0)  # fmt: skip
    graph = create_react_agent(llm, [add])
    question = f"What is {example['a']} + {example['b']}?"
    state = graph.invoke({"messages": [("user", question)]}, {"recursion_limit": 8})
    again = [*state["messages"], ("user", "Are you sure? The number only.")]
    state = graph.invoke({"messages": again}, {"recursion_limit": 8})
    return float(str(example["a"] + example["b"]) in str(state["messages"][-1].content))


def test_a_langgraph_agent_trains_unchanged(instruct, tmp_path):
    """The framework's requests (its fields, its echo of the history: no reasoning, its own
    message shapes) are served, and its second question continues the first's ids."""
    task = Sums()
    task.agent = react
    overrides = [*RUN, f"model.init_from={instruct}", "train.steps=1", "train.eval_every=0"]
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path / "run", task=task)
    (row,) = [r for r in rows if r["step"] == 1]
    assert row["agent_errors"] == 0 and row["agent_calls_mean"] >= 2
    assert row["agent_branches"] == 0 and row["episodes_trained"] == 4  # no history re-rendered


def test_an_agent_that_never_returns_does_not_keep_the_process_alive():
    """The agent pool's threads are daemons: a run whose agent hangs past its timeout (its
    session closed, its thread still asleep) exits when its main thread does."""
    code = (
        "import time\n"
        "from jaxrl_scale.rl.agents import AgentPool\n"
        "pool = AgentPool(2, 'agent')\n"
        "hung = pool.submit(time.sleep, 3600)\n"
        "done = pool.submit(lambda x: x + 1, 41)\n"
        "queued = [pool.submit(time.sleep, 3600) for _ in range(3)]\n"
        "assert done.result(timeout=30) == 42\n"
        "pool.shutdown()\n"
        "assert sum(f.cancelled() for f in queued) >= 2 and not hung.done()\n"
        "print('exiting')\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert time.monotonic() - started < 45
