"""Episodes on the chat templates people use (Qwen3, Qwen2.5, Llama-3.2; the published
templates in fixtures/chat_templates): observations and tool results cut from the template's
own rendering, the turn's real end token, malformed observations, tool episodes, and episodes
that cannot be trained left out of the loss."""

import json
import time
import warnings

import jax
import numpy as np
import pytest
import tokenizers
from conftest import FIXTURES, TINY_CONFIG
from test_episodes import Scripted

from jaxrl_scale.config import load_config
from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.rl.advantages import group_advantages
from jaxrl_scale.rl.episodes import EpisodeRunner
from jaxrl_scale.tasks.env import EnvRunner, Observations
from jaxrl_scale.tasks.user import UserTask

TEMPLATES = FIXTURES / "chat_templates"
SPECIAL = {
    "qwen2.5": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3.2": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"],
}  # fmt: skip
# The ids a checkpoint's generation config lists as ends, in its order: Llama-3.x Instruct
# lists <|end_of_text|> first, though a turn ends with <|eot_id|>.
ENDS = {
    "qwen2.5": ["<|im_end|>", "<|endoftext|>"],
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "llama3.2": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
}
TURN_END = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3.2": "<|eot_id|>"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}  # fmt: skip


def chat_tokenizer(name: str) -> Tokenizer:
    """A byte-level tokenizer (every text round-trips) with the family's special tokens and
    its published chat template, dates pinned."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL[name])
    ids = {t: backend.token_to_id(t) for t in SPECIAL[name]}
    special = {"eos_token": TURN_END[name]}
    if name == "llama3.2":
        special["bos_token"] = "<|begin_of_text|>"
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), special_tokens=special,
                            clock=lambda: __import__("datetime").datetime(2025, 3, 14))  # fmt: skip
    return Tokenizer(backend, eos_ids=[ids[t] for t in ENDS[name]], pad_id=ids[SPECIAL[name][0]],
                     chat_template=template)  # fmt: skip


def _id(tok: Tokenizer, text: str) -> int:
    return tok.backend.token_to_id(text)


OBSERVATIONS = {
    "user": "wrong, try again",
    "tool": [{"role": "tool", "content": json.dumps({"temperature": 21})}],
}


@pytest.mark.parametrize("observation", ["user", "tool"])
@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "llama3.2"])
def test_an_observation_continues_the_conversation_as_the_template_renders_it(name, observation):
    tok = chat_tokenizer(name)
    obs = Observations(tok)
    question, turn = "What is the weather in Paris?", "Let me check."
    end = _id(tok, TURN_END[name])
    given = OBSERVATIONS[observation]
    messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
    tools = [WEATHER] if observation == "tool" else None
    conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": turn},
                    *messages]  # fmt: skip
    want = tok.chat_template.render(conversation, tools=tools, add_generation_prompt=True)
    first = obs.first(question, tools)
    # The turn ended with the end-of-turn token the model sampled.
    after = obs.after_turn(given, tools, ended_with=end)
    assert first + turn + TURN_END[name] + after == want
    assert not after.startswith(TURN_END[name])  # never a second turn end
    # A turn cut off before its end token: the template's turn end closes it, as context.
    cut = obs.after_turn(given, tools, ended_with=None)
    assert cut.startswith(TURN_END[name]) and first + turn + cut == want


@pytest.mark.parametrize("end", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
def test_any_end_token_a_llama_turn_sampled_stands_for_the_templates_turn_end(end):
    tok = chat_tokenizer("llama3.2")
    after = Observations(tok).after_turn("again", ended_with=_id(tok, end))
    assert after.startswith("<|start_header_id|>user<|end_header_id|>")  # no second end


class Weather:
    """Asks, gets a tool result, then a user nudge, then ends: reward 1 for "21"."""

    tools = [WEATHER]

    def __init__(self, example):
        self.example, self.turn = example, 0

    def reset(self):
        return [{"role": "user", "content": self.example["question"]}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "tool", "content": '{"temperature": 21}'}], 0.0, False
        if self.turn == 2:
            return "Answer with the number only.", 0.0, False
        return None, float(action.strip() == "21"), True


class WeatherTask:
    def __init__(self, tok, make=Weather):
        self.tokenizer, self.make = tok, make
        self.train_examples = [{"question": "Weather in Paris?"}]
        self.eval_examples = self.train_examples

    def make_env(self, example):
        return self.make(example)


def _episodes(tok, task, answers, *overrides, end=None):
    cfg = load_config(TINY_CONFIG, ["task.max_turns=4", "task.max_episode_tokens=2048",
                                    "sampler.max_new_tokens=256", *overrides])  # fmt: skip
    generate = Scripted(tok, answers, tok.eos_ids[-1] if end is None else end)
    runner = EpisodeRunner(
        cfg,
        task,
        tok,
        generate,
        EnvRunner(workers=cfg.task.env_workers, timeout=cfg.task.env_timeout),
    )
    return runner, generate


@pytest.mark.parametrize("name", ["qwen3", "llama3.2"])
def test_a_multi_turn_tool_episode_runs_to_its_end_on_the_published_template(name):
    tok = chat_tokenizer(name)
    end = _id(tok, TURN_END[name])
    thinking = "<think>\nIt needs the tool.\n</think>\n\n" if name == "qwen3" else ""
    answers = [thinking + '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}\n</tool_call>', "It is 21 degrees.", "21"]  # fmt: skip
    runner, generate = _episodes(tok, WeatherTask(tok), answers, end=end)
    ro, rewards, stats = runner.run(None, WeatherTask(tok).train_examples, jax.random.key(0),
                                    sampling=None, repeat=2)  # fmt: skip
    assert stats["env_errors"] == 0 and stats["turns_mean"] == 3
    np.testing.assert_array_equal(rewards, [1.0, 1.0])
    n = int(ro.lengths[0])
    tokens, mask = ro.completion_tokens[0, :n], ro.completion_mask[0, :n]
    prompt = ro.prompt_tokens[0][ro.prompt_mask[0]]
    text = tok.decode(list(prompt) + list(tokens), skip_special_tokens=False)
    # The model's turns as sampled, reasoning kept; each observation as the template writes
    # it; nothing re-rendered. Without reasoning, the template's own whole rendering.
    turns = [{"role": "assistant", "content": a} for a in answers]
    conversation = [
        {"role": "user", "content": "Weather in Paris?"}, turns[0],
        {"role": "tool", "content": '{"temperature": 21}'}, turns[1],
        {"role": "user", "content": "Answer with the number only."}, turns[2],
    ]  # fmt: skip
    if name == "qwen3":
        assert thinking in text  # the sampled reasoning stays (the template would drop it)
        text = text.replace(thinking, "")
        turns[0]["content"] = answers[0].replace(thinking, "")
    # Up to the last turn, then that turn as sampled (Qwen3 writes a last assistant turn with
    # an empty <think> block the model never sampled).
    want = tok.chat_template.render(conversation[:-1], tools=[WEATHER], add_generation_prompt=True)
    assert text == want + answers[2] + TURN_END[name]
    # Sampled tokens train (mask 1), the observations are context (mask 0).
    sampled = sum(len(tok.encode(a)) + 1 for a in answers)
    assert mask.sum() == sampled and mask[-1] == 1
    # The third turn read the whole episode so far, as sampled.
    assert generate.contexts[2][0] == list(prompt) + list(tokens[: n - len(tok.encode("21")) - 1])


class Malformed(Weather):
    def __init__(self, example, content):
        super().__init__(example)
        self.content = content

    def step(self, action):
        return [{"role": "user", "content": self.content}], 0.0, False


@pytest.mark.parametrize("content", [7, __import__("decimal").Decimal("1.5"), {"a": 1}])
def test_a_malformed_observation_ends_its_episode_counted_and_the_run_goes_on(content):
    tok = chat_tokenizer("qwen2.5")
    task = WeatherTask(tok, make=lambda e: Malformed(e, content))
    runner, _ = _episodes(tok, task, ["hi"] * 4)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _, rewards, stats = runner.run(None, task.train_examples, jax.random.key(0),
                                       sampling=None, repeat=2)  # fmt: skip
    assert stats["env_errors"] == 2 and np.isnan(rewards).all()


class BadTools(Weather):
    tools = {"name": "not a list"}


def test_tools_that_are_not_a_list_end_the_episode_counted():
    tok = chat_tokenizer("qwen2.5")
    runner, _ = _episodes(tok, WeatherTask(tok, make=BadTools), ["hi"] * 4)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _, rewards, stats = runner.run(None, [{"question": "q"}], jax.random.key(0),
                                       sampling=None, repeat=2)  # fmt: skip
    assert stats["env_errors"] == 2 and np.isnan(rewards).all()


class Flaky(Weather):
    """reset raises for the episodes `fail` names (by the order they were made)."""

    made = 0

    def __init__(self, example, fail, prompts):
        super().__init__(example)
        self.number, Flaky.made = Flaky.made, Flaky.made + 1
        self.fail, self.prompts = fail, prompts

    def reset(self):
        if self.number in self.fail:
            raise RuntimeError("the environment broke")
        return self.prompts[self.number]

    def step(self, action):
        return None, float(self.number % 2), True


def _flaky(fail, prompts, group=4):
    tok = chat_tokenizer("qwen2.5")
    Flaky.made = 0
    task = WeatherTask(tok, make=lambda e: Flaky(e, fail, prompts))
    runner, _ = _episodes(tok, task, ["a"] * 2, "task.max_turns=1", "task.env_workers=1",
                          f"train.group_size={group}")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro, rewards, stats = runner.run(None, task.train_examples, jax.random.key(0),
                                        sampling=None, repeat=group)  # fmt: skip
    return tok, ro, rewards, stats, caught


def test_episodes_their_environment_failed_are_left_out_of_the_loss_not_scored_zero():
    # Episode 0 of the group fails in reset: it is not a reward of 0 that punishes the policy.
    tok, ro, rewards, stats, caught = _flaky({0}, ["Q"] * 4)
    assert stats["env_errors"] == 1 and len(caught) == 1
    assert np.isnan(rewards[0]) and list(rewards[1:]) == [1.0, 0.0, 1.0]
    adv, keep = group_advantages(rewards, group_size=4, normalize="none")
    assert list(np.asarray(keep)) == [False, True, True, True]
    np.testing.assert_allclose(adv, [0, 1 / 3, -2 / 3, 1 / 3], atol=1e-6)
    # Every row of the group carries the group's prompt, the failed first row too (the train
    # step reads each group's first row).
    want = tok.encode(Observations(tok).first("Q", [WEATHER]))
    for row in range(4):
        assert list(ro.prompt_tokens[row][ro.prompt_mask[row]]) == want


def test_an_episode_whose_first_observation_differs_from_its_groups_is_dropped_counted():
    tok, ro, rewards, stats, caught = _flaky(set(), ["Q", "Q", "other", "Q"])
    assert stats["episodes_prompt_mismatch"] == 1
    assert np.isnan(rewards[2]) and np.isfinite(np.delete(rewards, 2)).all()
    assert any("episodes_prompt_mismatch" in str(w.message) for w in caught)
    want = tok.encode(Observations(tok).first("Q", [WEATHER]))
    assert list(ro.prompt_tokens[0][ro.prompt_mask[0]]) == want


class Scores:
    """A tool task whose chat prompt has a system message and whose score has named parts."""

    def __init__(self, tok):
        self.tokenizer = tok
        self.tools = [get_weather]
        self.reward_weights = {"format": 0.25}
        self.train_examples = [
            {
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"},
                ]
            }
        ]
        self.eval_examples = self.train_examples

    def score(self, completion, example):
        return {"format": 1.0, "correct": float(completion.strip() == "21")}


def get_weather(city: str) -> str:
    """Current temperature in a city."""
    return "21"


def test_a_tool_task_sends_its_chat_messages_once_and_combines_named_parts():
    tok = chat_tokenizer("qwen2.5")
    task = UserTask(Scores(tok), tokenizer=tok)
    env = task.make_env(task.train_examples[0])
    first = Observations(tok).first(env.reset(), env.tools)
    want = tok.chat_template.render(Scores(tok).train_examples[0]["prompt"],
                                    tools=env.tools, add_generation_prompt=True)  # fmt: skip
    assert first == want  # the system message as given, not the rendered text wrapped again
    assert first.count("<|im_start|>system") == 1
    _, reward, done = env.step("21")
    assert done and reward == 0.25 * 1.0 + 1.0


class LongTools(Weather):
    tools = [WEATHER] * 40  # their schemas alone are longer than the episode's budget


def test_an_episode_whose_prompt_alone_fills_the_budget_is_counted_and_warned_about():
    tok = chat_tokenizer("qwen2.5")
    runner, generate = _episodes(tok, WeatherTask(tok, make=LongTools), ["a"] * 2,
                                 "task.max_episode_tokens=256")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, rewards, stats = runner.run(None, [{"question": "q"}], jax.random.key(0),
                                       sampling=None, repeat=2)  # fmt: skip
    # Counted once, under their own key: not also as episodes whose turns ran out of tokens.
    assert stats["episodes_prompt_too_long"] == 2 and stats["episodes_truncated"] == 0
    assert np.isnan(rewards).all() and generate.calls == 0
    assert any("task.max_episode_tokens" in str(w.message) for w in caught)


def test_a_held_out_evaluation_keeps_the_return_of_an_episode_unlike_its_group():
    # Training leaves the odd one out (NaN); an evaluation counts what it returned.
    tok = chat_tokenizer("qwen2.5")
    Flaky.made = 0
    task = WeatherTask(tok, make=lambda e: Flaky(e, set(), ["Q", "other", "Q", "Q"]))
    runner, _ = _episodes(tok, task, ["a"] * 2, "task.max_turns=1", "task.env_workers=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, returns, _ = runner.run(None, task.train_examples, jax.random.key(0),
                                   sampling=None, repeat=4, training=False)  # fmt: skip
    assert list(returns) == [0.0, 1.0, 0.0, 1.0]


class Flood(Weather):
    """A tool that answers 4 MB."""

    def step(self, action):
        return [{"role": "tool", "content": "x" * 4_000_000}], 0.0, False


def test_an_observation_is_cut_to_the_room_left_before_it_is_tokenized():
    tok = chat_tokenizer("qwen2.5")
    runner, _ = _episodes(tok, WeatherTask(tok, make=Flood), ["a"] * 2,
                          "task.max_episode_tokens=1024")  # fmt: skip
    start = time.perf_counter()
    ro, _, stats = runner.run(None, [{"question": "q"}], jax.random.key(0), sampling=None,
                              repeat=1)  # fmt: skip
    # Tokenizing 4 MB byte by byte takes seconds here; 64 characters a token of room does not.
    assert time.perf_counter() - start < 2.0
    assert stats["episodes_truncated"] == 1 and stats["env_errors"] == 0
    assert ro.lengths[0] + ro.prompt_mask[0].sum() == 1024


def test_tool_episodes_weigh_named_parts_with_the_configs_weights_over_the_tasks():
    tok = chat_tokenizer("qwen2.5")
    task = UserTask(Scores(tok), tokenizer=tok, reward_weights={"correct": 2.0})
    _, reward, done = task.make_env(task.train_examples[0]).step("21")
    assert done and reward == 0.25 * 1.0 + 2.0 * 1.0


class Sleepy(Flaky):
    def step(self, action):
        if self.number == 0:
            time.sleep(30)  # past task.env_timeout: its worker is killed
        return "go on", 0.0, False


def test_episodes_lost_with_a_worker_killed_for_another_ones_hang_are_counted_apart():
    tok = chat_tokenizer("qwen2.5")
    Flaky.made = 0
    task = WeatherTask(tok, make=lambda e: Sleepy(e, set(), ["Q"] * 3))
    runner, _ = _episodes(tok, task, ["a"] * 3, "task.max_turns=2", "task.env_workers=1",
                          "task.env_timeout=1")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, rewards, stats = runner.run(None, task.train_examples, jax.random.key(0),
                                       sampling=None, repeat=3)  # fmt: skip
    # The hung one is the environment's failure; the two that shared its worker were lost.
    assert stats["env_errors"] == 1 and stats["episodes_lost"] == 2
    assert np.isnan(rewards).all()
