"""Multi-turn episodes: the token layout and masks, observations through a chat template,
environments that fail, and a run that trains on episodes."""

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from conftest import FAST, FIXTURES, TINY_CONFIG
from flax import nnx

from jaxrl_scale.config import load_config
from jaxrl_scale.configbase import ConfigError
from jaxrl_scale.generation.sampler import EOS, LENGTH, Rollout, Sampling
from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.policy import init_policy
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.parallel.sharding import make_mesh
from jaxrl_scale.rl.curriculum import Curriculum
from jaxrl_scale.rl.episodes import EngineEpisodes, EpisodeRunner
from jaxrl_scale.rl.generator import WaveGenerator
from jaxrl_scale.rl.losses import policy_loss
from jaxrl_scale.tasks.env import EnvError, EnvRunner, GymText, Observations, TextArena
from jaxrl_scale.tasks.scoring import ScorerBroken
from jaxrl_scale.tasks.tools import ToolEnv, parse_calls, schema
from jaxrl_scale.tasks.user import UserTask
from jaxrl_scale.tasks.workers import WorkerPool
from jaxrl_scale.train import train

KEY = jax.random.key(0)
GREEDY = Sampling(0.0)
QWEN25 = (FIXTURES / "chat_templates" / "qwen2.5.jinja").read_text()


@pytest.fixture
def retry_env(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))
    import retry_env

    return retry_env


class Scripted:
    """A stand-in generator: each call answers every context with the next of `answers`
    (text, then `end`: the first end-of-sequence id unless given), every sampled token at
    log-prob -0.5 and policy version `calls`."""

    def __init__(self, tok, answers, end=None):
        self.tok, self.answers, self.calls, self.contexts = tok, answers, 0, []
        self.end = tok.eos_ids[0] if end is None else end

    def __call__(self, params_for_chunk, contexts, key, *, sampling, n_new):
        self.contexts.append([list(c) for c in contexts])
        ids = self.tok.encode(self.answers[self.calls]) + [self.end]
        self.calls += 1
        b, k = len(contexts), min(len(ids), n_new)
        tokens = np.full((b, n_new), self.tok.pad_id, np.int32)
        tokens[:, :k] = ids[:k]
        mask = np.zeros((b, n_new), np.float32)
        mask[:, :k] = 1
        prompt = np.ones((b, 1), np.int32)
        return Rollout(prompt, prompt.astype(bool), tokens, mask, -0.5 * mask,
                       np.where(mask > 0, self.calls, -1).astype(np.int32),
                       np.full(b, EOS, np.int32), np.full(b, k, np.int32))  # fmt: skip


def _runner(retry_env, answers, *overrides, fail_on=None):
    cfg = load_config(TINY_CONFIG, ["sampler.max_new_tokens=4", *overrides])
    task = retry_env.make(fail_on=fail_on)
    generate = Scripted(task.tokenizer, answers)
    envs = EnvRunner(workers=4, timeout=cfg.task.env_timeout)
    return EpisodeRunner(cfg, task, task.tokenizer, generate, envs), task, generate


def test_an_episode_is_its_turns_as_sampled_between_observations_masked_out(retry_env):
    runner, task, generate = _runner(retry_env, ["9", "3"], "task.max_turns=3")
    example = {"question": "1+2", "answer": 3}
    ro, rewards, stats = runner.run(None, [example], KEY, sampling=None, repeat=2)
    tok = task.tokenizer
    eos, pad = tok.eos_ids[0], tok.pad_id
    # Turn 1 "9"+EOS (sampled, version 1), the observation " =" (context), turn 2 "3"+EOS.
    want = tok.encode("9") + [eos] + tok.encode(" =") + tok.encode("3") + [eos]
    n = len(want)
    for row in range(2):
        assert list(ro.completion_tokens[row, :n]) == want
        assert (ro.completion_tokens[row, n:] == pad).all()
        assert list(ro.completion_mask[row, :n]) == [1, 1, 0, 0, 1, 1]
        assert list(ro.behavior_logp[row, :n]) == [-0.5, -0.5, 0, 0, -0.5, -0.5]
        assert list(ro.versions[row, :n]) == [1, 1, -1, -1, 2, 2]
        assert ro.lengths[row] == n and ro.finish_reason[row] == EOS
        prompt = ro.prompt_tokens[row][ro.prompt_mask[row]]
        assert list(prompt) == tok.encode("1+2=")
    # The second turn read the whole episode so far: the prompt, turn 1, the observation.
    assert generate.contexts[1][0] == tok.encode("1+2=") + want[:4]
    np.testing.assert_array_equal(rewards, [1.0, 1.0])
    assert stats["turns_mean"] == 2 and stats["env_errors"] == 0
    assert stats["episodes_truncated"] == 0 and stats["episodes_out_of_turns"] == 0


def test_out_of_turns_or_tokens_an_episode_is_truncated(retry_env):
    runner, _, _ = _runner(retry_env, ["9", "8"], "task.max_turns=2")
    ro, rewards, stats = runner.run(None, [{"question": "1+2", "answer": 3}], KEY,
                                    sampling=None, repeat=1)  # fmt: skip
    # Out of turns: counted as such, not as out of tokens (one key per cause).
    assert rewards[0] == 0 and ro.finish_reason[0] == LENGTH
    assert stats["episodes_out_of_turns"] == 1 and stats["episodes_truncated"] == 0
    # A budget of 6 tokens: the prompt (4) and turn 1 (2) fill it; no observation follows.
    runner, _, generate = _runner(retry_env, ["9", "3"], "task.max_episode_tokens=6")
    ro, _, stats = runner.run(None, [{"question": "1+2", "answer": 3}], KEY,
                              sampling=None, repeat=1)  # fmt: skip
    assert stats["episodes_truncated"] == 1 and ro.lengths[0] == 2 and generate.calls == 1
    assert stats["episodes_out_of_turns"] == 0


@pytest.mark.parametrize("fail_on", ["reset", "step", "hang"])
def test_an_environment_that_fails_ends_its_episode_left_out_counted(retry_env, fail_on):
    runner, _, _ = _runner(retry_env, ["3"] * 3, "task.env_timeout=0.5", fail_on=fail_on)
    examples = [{"question": "1+2", "answer": 3}, {"question": "2+2", "answer": 4}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro, rewards, stats = runner.run(None, examples, KEY, sampling=None, repeat=2)
    failed = stats["env_errors"] + stats["episodes_lost"]  # a hang's worker takes others along
    assert failed == 4 and np.isnan(rewards).all()  # left out, not 0
    assert ro.completion_tokens.shape[0] == 4
    assert len(caught) == 1  # the first failure is logged, the rest counted


def test_observations_continue_the_conversation_as_the_chat_template_renders_it():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<|im_end|>": 1},
                                                               unk_token="<unk>"))  # fmt: skip
    backend.add_special_tokens(["<|im_end|>"])
    template = ChatTemplate(QWEN25, special_tokens={"eos_token": "<|im_end|>"})
    tok = Tokenizer(backend, eos_ids=[1], pad_id=0, chat_template=template)
    obs = Observations(tok)
    first, after = obs.first("What is 2+2?"), obs.after_turn("wrong, try again", ended_with=1)
    # The model's turn ends at the end-of-turn token it samples; what the template puts after
    # it ("\n"), the user turn and the next assistant header are the observation's.
    assert after == "\n<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"
    conversation = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "wrong, try again"},
    ]
    # Prompt + the model's turn (with its end-of-turn token) + the observation: the template's
    # own rendering of the whole conversation.
    assert first + "5<|im_end|>" + after == template.render(conversation)


def test_a_multi_turn_task_trains_from_yaml(retry_env, tmp_path):
    overrides = [
        *FAST, "task.name=retry_env:make", "sampler.batching=static", "task.max_turns=2",
        "task.max_episode_tokens=24", "train.steps=2", "warm_start.steps=0",
    ]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 1 <= r["turns_mean"] <= 2 and r["env_errors"] == 0
        # gen_tokens counts sampled tokens only: at most 4 per turn, 2 turns, 16 episodes.
        assert 16 <= r["gen_tokens"] <= 2 * 4 * 16
        assert 0 <= r["pass_rate"] <= 1
    assert 0 <= rows[-1]["eval_pass_rate"] <= 1 and 1 <= rows[-1]["eval_turns_mean"] <= 2


# --------------------------------------------------------------------------- slot engine


class Steps:
    """An environment that ends after the example's `turns` turns (reward: the turn count),
    each observation longer than the one before: episodes that end at different turns."""

    def __init__(self, example):
        self.turns, self.seen = example["turns"], 0

    def reset(self):
        return example_prompt(self.turns)

    def step(self, action):
        time.sleep(0.05)  # longer than an engine run: waiting rows move to parking
        self.seen += 1
        if self.seen >= self.turns:
            return None, float(self.seen), True
        return " " + "=" * self.seen, 0.0, False


def example_prompt(turns):
    return f"{turns}+{turns}="


class StepsTask:
    name = "steps"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.train_examples = [{"turns": 1 + i % 3} for i in range(16)]
        self.eval_examples = self.train_examples[:4]

    def make_env(self, example):
        return Steps(example)


def _engine_and_waves(retry_env, *overrides, fail_on=None, slots=4):
    overrides = [*FAST, "task.max_turns=3", "task.max_episode_tokens=24", "train.group_size=2",
                 "pipeline.mode=sync", *overrides]  # fmt: skip
    cfg = load_config(TINY_CONFIG, overrides)
    task = retry_env.make(fail_on=fail_on)
    if fail_on is None:  # episodes of 1, 2 and 3 turns
        task = StepsTask(task.tokenizer)
    graphdef, params = nnx.split(init_policy(cfg.model, seed=3))
    mesh = make_mesh(cfg.mesh)
    waves = WaveGenerator(cfg, graphdef, task.tokenizer, None, mesh=mesh, own_devices=False,
                          longest_prompt=cfg.task.max_episode_tokens)  # fmt: skip
    envs = EnvRunner(workers=4, timeout=cfg.task.env_timeout)
    runner = EpisodeRunner(cfg, task, task.tokenizer, waves.generate, envs)
    engine = EngineEpisodes(
        cfg, graphdef, task.tokenizer, runner, mesh=mesh, slots=slots, sampling=GREEDY,
        curriculum=Curriculum(len(task.train_examples), seed=0), examples=task.train_examples,
    )  # fmt: skip
    return engine, runner, task, params


@pytest.mark.parametrize("parked_rows, prompt_tokens", [(-1, 0), (0, 2)])
def test_episodes_on_the_slot_engine_equal_the_turn_by_turn_waves(
    retry_env, parked_rows, prompt_tokens
):
    """Greedy episodes (8 on 4 slots): the engine, which feeds each observation into the
    episode's cache (and moves episodes waiting for their environment off their slots to
    parking rows and back; or, with 2 prompt columns, feeds the rest of each 4-token first
    observation as given tokens too), gives the tokens, masks, versions and rewards of the
    static path, which prefills every turn's whole context; log-probs to float precision."""
    engine, runner, task, params = _engine_and_waves(
        retry_env, f"sampler.parked_rows={parked_rows}", f"task.prompt_tokens={prompt_tokens}"
    )
    indices, ro, rewards, stats = engine.next(lambda chunk: (0, params), KEY, None)
    examples = [task.train_examples[i] for i in indices]
    want, want_rewards, want_stats = runner.run(lambda chunk: (0, params), examples, KEY,
                                                sampling=GREEDY, repeat=2)  # fmt: skip
    for name in ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask",
                 "versions", "finish_reason", "lengths"):  # fmt: skip
        np.testing.assert_array_equal(getattr(ro, name), getattr(want, name), err_msg=name)
    np.testing.assert_allclose(ro.behavior_logp, want.behavior_logp, atol=1e-5)
    np.testing.assert_array_equal(rewards, want_rewards)
    for name in ("turns_mean", "env_errors", "episodes_truncated", "episodes_out_of_turns"):
        assert stats[name] == want_stats[name], name
    # The batch has what makes the comparison bite: observations between turns, and rows
    # that end at different turns.
    assert (np.diff(ro.completion_mask, axis=1) == -1).sum() > len(rewards)
    assert len(set(ro.lengths.tolist())) > 1
    assert engine.engine.busy == 0 and not engine.live
    assert (engine.engine.moves > 0) == (parked_rows != 0)
    # Prompt columns: the first batch's longest first observation ("3+3=") rounded up to 8.
    assert engine.engine.prompt_len == (prompt_tokens or 8)


def test_a_multi_turn_task_trains_in_pipeline_rl_on_the_slot_engine(retry_env, tmp_path):
    """16 episodes a step on 8 slots, the next batch queued behind: the staleness bound holds
    per token across turns, and on a batch sampled by the parameters that train on it every
    behaviour log-prob equals the trainer's recomputation of the whole episode (observations
    fed into a slot's cache are the context the trainer sees)."""
    overrides = [
        *FAST, "task.name=retry_env:make", "sampler.batching=continuous", "sampler.slots=8",
        "task.max_turns=3", "task.max_episode_tokens=24", "train.steps=3", "warm_start.steps=0",
        "pipeline.mode=pipeline_rl", "pipeline.max_staleness=1",
    ]  # fmt: skip
    rows = train(load_config(TINY_CONFIG, overrides), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert 1 <= r["turns_mean"] <= 3 and r["env_errors"] == 0
        assert r["turns_mean"] > 1  # the untrained model rarely answers right at once
        assert 16 <= r["gen_tokens"] <= 3 * 4 * 16 and r["staleness_max"] <= 1
        if r["staleness_max"] == 0:
            assert r["mismatch_max"] < 1e-4
    assert rows[1]["staleness_max"] == 0
    assert 0 <= rows[-1]["eval_pass_rate"] <= 1


@pytest.mark.parametrize("fail_on", ["reset", "step", "hang"])
def test_an_environment_that_fails_on_the_engine_costs_its_episode(retry_env, fail_on):
    engine, _, _, params = _engine_and_waves(retry_env, "task.env_timeout=0.5", fail_on=fail_on)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _, ro, rewards, stats = engine.next(lambda chunk: (0, params), KEY, None)
    # A hang kills its worker process: the environments that shared it are lost with it.
    failed = stats["env_errors"] + stats["episodes_lost"]
    assert failed == 8 and stats["env_errors"] >= 1 and np.isnan(rewards).all()
    assert ro.completion_tokens.shape[0] == 8
    if fail_on != "hang":
        assert stats["episodes_lost"] == 0
    assert engine.engine is not None and engine.engine.busy == 0 and not engine.calls


# --------------------------------------------------------------------------- tools


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    More text that is not the description."""
    return a + b


def explode(x: str) -> str:
    """Always fails."""
    raise RuntimeError("boom")


def sleepy() -> str:
    """Never answers in time."""
    time.sleep(10)
    return "late"


def test_a_tool_schema_comes_from_the_signature_and_docstring():
    assert schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"],
            },
        },
    }


def test_tool_calls_are_parsed_and_malformed_ones_explained():
    text = (
        'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
    )
    calls = parse_calls(text)
    assert calls[:2] == [{"name": "add", "arguments": {"a": 2, "b": 3}},
                         {"name": "add", "arguments": {"a": 1}}]  # fmt: skip
    assert "not JSON" in calls[2] and '"name"' in calls[3] and "JSON object" in calls[4]
    assert parse_calls("no calls here") == []


def test_a_tool_episode_answers_calls_and_errors_and_scores_the_final_answer():
    pool = WorkerPool(2)
    example = {"prompt": "What is 2+3?", "answer": "5"}
    env = ToolEnv(example, [add, explode, sleepy], lambda c, e: float(c.strip() == "5"),
                  pool=pool, timeout=0.3)  # fmt: skip
    assert [t["function"]["name"] for t in env.tools] == ["add", "explode", "sleepy"]
    assert env.reset() == [{"role": "user", "content": "What is 2+3?"}]
    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
    turn = "".join([
        call % ("add", '{"a": 2, "b": 3}'), call % ("nope", "{}"), call % ("add", '{"c": 1}'),
        call % ("explode", '{"x": "y"}'), call % ("sleepy", "{}"), "<tool_call>{x</tool_call>",
    ])  # fmt: skip
    obs, reward, done = env.step(turn)
    assert not done and reward == 0 and [m["role"] for m in obs] == ["tool"] * 6
    answers = [m["content"] for m in obs]
    assert answers[0] == "5"
    assert answers[1].startswith("error: no tool named 'nope'")
    assert answers[2] == "error: add: missing a required argument: 'a'"
    assert answers[3] == "error: explode raised RuntimeError: boom"
    assert answers[4] == "error: sleepy did not answer within 0.3 s"
    assert answers[5].startswith("error: the tool call is not JSON")
    assert env.tool_errors == 5
    assert env.step("<think>2+3</think> 5") == (None, 1.0, True)
    assert env.step("<think>unclosed 5")[1] == 0.0


def test_tool_episodes_offer_the_tools_through_the_chat_template():
    tok = _byte_tokenizer()
    task = UserTask(_AddTask(), tokenizer=tok)
    assert task.make_env is not None
    cfg = load_config(TINY_CONFIG, ["task.max_turns=3", "task.max_episode_tokens=4096",
                                    "sampler.max_new_tokens=96"])  # fmt: skip
    calls = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    generate = Scripted(tok, [calls, "5"])
    runner = EpisodeRunner(cfg, task, tok, generate, EnvRunner(workers=2, timeout=5))
    ro, rewards, stats = runner.run(None, task.train_examples, KEY, sampling=None, repeat=1)
    assert rewards[0] == 1.0 and stats["turns_mean"] == 2 and stats["tool_errors"] == 0
    prompt = tok.decode(ro.prompt_tokens[0][ro.prompt_mask[0]], skip_special_tokens=False)
    assert '"name": "add"' in prompt and "<tools>" in prompt  # Qwen2.5's tool section
    episode = tok.decode(ro.completion_tokens[0, : ro.lengths[0]], skip_special_tokens=False)
    observation = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    assert episode == calls + "<|im_end|>" + observation + "<|im_start|>assistant\n5<|im_end|>"


class _AddTask:
    tools = [add]
    train_examples = [{"prompt": "What is 2+3?", "answer": "5"}]
    eval_examples = train_examples

    def score(self, completion, example):
        return float(completion.strip() == example["answer"])


def _byte_tokenizer():
    """Any text in and out (bytes as tokens) and Qwen's end-of-turn token, with the Qwen2.5
    chat template."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|im_end|>": 0, **{c: i + 1 for i, c in enumerate(sorted(alphabet))}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["<|im_end|>"])
    template = ChatTemplate(QWEN25, special_tokens={"eos_token": "<|im_end|>"})
    return Tokenizer(backend, eos_ids=[0], pad_id=0, chat_template=template)


# --------------------------------------------------------------------------- gym-style


class HigherLower:
    """A Gymnasium-style text game: guess a digit, told "higher"/"lower" (5-tuple steps)."""

    def reset(self, seed=None):
        self.target = 0 if seed is None else seed % 10
        return "guess:", {}

    def step(self, action):
        guess = int(action.strip() or -1)
        if guess == self.target:
            return "", 1.0, True, False, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, False, {}


def test_a_gym_style_environment_runs_as_an_episode():
    env = GymText(HigherLower(), seed=7)
    assert env.reset() == "guess:"
    assert env.step("3") == ("higher", 0.0, False)
    assert env.step("9") == ("lower", 0.0, False)
    assert env.step("7") == (None, 1.0, True)

    class Old:  # gym's older 4-tuple
        def reset(self):
            return "start"

        def step(self, action):
            return "next", 0.5, action == "stop", {}

    old = GymText(Old())
    assert old.reset() == "start" and old.step("go") == ("next", 0.5, False)
    assert old.step("stop") == (None, 0.5, True)


class ArenaGuess:
    """textarena's single-player API, as its 0.7 games behave: `get_observation` gives the
    messages since the player's last turn as (sender, message, kind) triples, the player's own
    action echoed among them (sender 0; the game is -1), and `close` the rewards per player."""

    def __init__(self, transcript: bool = False):
        self.transcript, self.log, self.pending = transcript, "", []

    def reset(self, num_players, seed=None):
        assert num_players == 1
        self.target, self.done = seed % 20 + 1, False
        self._say((-1, "Guess the number between 1 and 20, e.g. [5].", 0))

    def _say(self, *messages):
        self.pending += messages
        self.log += "".join(f"\n{m[1]}" for m in messages)

    def get_observation(self):
        if self.transcript:  # a wrapped game: the whole transcript each time
            return 0, self.log
        out, self.pending = self.pending, []
        return 0, out

    def step(self, action):
        guess = int(action.strip(" []"))
        self._say((0, action, 2))
        self.done = guess == self.target
        if not self.done:
            self._say((-1, "higher." if guess < self.target else "lower.", 4))
        return self.done, {}

    def close(self):
        return {0: 1.0 if self.done else 0.0}, {0: {"reason": "closed"}}


@pytest.mark.parametrize("transcript", [False, True])
def test_a_textarena_game_runs_as_an_episode(transcript):
    env = TextArena(ArenaGuess(transcript), seed=6)  # the number is 7
    assert env.reset().strip() == "Guess the number between 1 and 20, e.g. [5]."
    obs, reward, done = env.step("[3]")
    # the game's answer only: the model's own action, echoed by the game, is not observed
    assert (obs.strip(), reward, done) == (("[3]\n" if transcript else "") + "higher.", 0.0, False)
    assert env.step("[9]")[0].strip().endswith("lower.") and "higher" not in env.step("[8]")[0]
    assert env.step("[7]") == (None, 1.0, True)

    class Broken(ArenaGuess):
        def close(self):
            return None, {}

    broken = TextArena(Broken(), seed=0)
    broken.reset()
    with pytest.raises(EnvError, match="no reward for player 0"):
        broken.step("[1]")


@pytest.mark.parametrize("kind", ["cispo", "dapo", "gspo", "grpo"])
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_observation_tokens_never_reach_the_loss(kind, aggregation):
    """An episode's row (turn, observation, turn): the loss and its gradients are those of
    the turns' tokens alone: nothing flows to the observation positions, whatever the
    log-probs found there."""
    mask = np.array([[1, 1, 0, 0, 0, 1, 1, 0]] * 2 + [[1, 1, 1, 1, 0, 0, 0, 0]] * 2, np.float32)
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-1.0, 0.3, mask.shape), jnp.float32)
    behavior = jnp.asarray(np.where(mask > 0, rng.normal(-1.0, 0.3, mask.shape), 0.0))
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    extra = {"ref_logp_bt": logp - 0.1, "kl_coef": 0.1} if kind == "grpo" else {}

    def loss(lp):
        return policy_loss(lp, behavior, adv, mask, 2, kind, aggregation, **extra)[0]

    value, grad = jax.value_and_grad(loss)(logp)
    assert np.all(np.asarray(grad)[mask == 0] == 0) and np.any(np.asarray(grad)[mask > 0])
    # Other log-probs at the observation positions change nothing.
    shifted = logp + jnp.asarray((mask == 0) * 3.0)
    assert float(loss(shifted)) == pytest.approx(float(value), rel=1e-6)


def test_router_replay_with_a_multi_turn_task_is_refused_at_setup(retry_env, tmp_path):
    moe = ["model.architecture=qwen3_moe", "model.qk_norm=true", "model.num_experts=4",
           "model.num_experts_per_tok=2", "model.moe_intermediate_size=16",
           "model.router_replay=true"]  # fmt: skip
    cfg = load_config(TINY_CONFIG, [*FAST, *moe, "task.name=retry_env:make", "task.max_turns=2",
                                    "task.max_episode_tokens=24", "train.steps=1"])  # fmt: skip
    with pytest.raises(ConfigError, match="model.router_replay"):
        train(cfg, tmp_path)


def test_a_run_whose_environments_mostly_fail_ends_naming_the_key(retry_env, tmp_path):
    overrides = [*FAST, "task.name=retry_env:make", "task.args.fail_on=reset",
                 "sampler.batching=static", "task.max_turns=2", "task.max_episode_tokens=24",
                 "train.steps=2", "warm_start.steps=0"]  # fmt: skip
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as ended:
        warnings.simplefilter("ignore")
        train(load_config(TINY_CONFIG, overrides), tmp_path)
    cause = ended.value if isinstance(ended.value, ScorerBroken) else ended.value.__cause__
    assert isinstance(cause, ScorerBroken)
    assert "16 of a batch's 16 episodes" in str(cause) and "task.max_failure_fraction" in str(cause)
