"""Multi-turn episodes: the token layout and masks, observations through a chat template,
environments that fail, and a run that trains on episodes."""

import warnings

import jax
import numpy as np
import pytest
import tokenizers
from conftest import FAST, FIXTURES, TINY_CONFIG

from jaxrl_scale.config import load_config
from jaxrl_scale.generation.sampler import EOS, LENGTH, Rollout
from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.rl.episodes import EpisodeRunner
from jaxrl_scale.tasks.env import EnvRunner, Observations
from jaxrl_scale.train import train

KEY = jax.random.key(0)
QWEN25 = (FIXTURES / "chat_templates" / "qwen2.5.jinja").read_text()


@pytest.fixture
def retry_env(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES / "tasks"))
    import retry_env

    return retry_env


class Scripted:
    """A stand-in generator: each call answers every context with the next of `answers`
    (text, then EOS), every sampled token at log-prob -0.5 and policy version `calls`."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.calls, self.contexts = tok, answers, 0, []

    def __call__(self, params_for_chunk, contexts, key, *, sampling, n_new):
        self.contexts.append([list(c) for c in contexts])
        ids = self.tok.encode(self.answers[self.calls]) + [self.tok.eos_ids[0]]
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
    assert stats["episodes_truncated"] == 0 and task.made == 2


def test_out_of_turns_or_tokens_an_episode_is_truncated(retry_env):
    runner, _, _ = _runner(retry_env, ["9", "8"], "task.max_turns=2")
    ro, rewards, stats = runner.run(None, [{"question": "1+2", "answer": 3}], KEY,
                                    sampling=None, repeat=1)  # fmt: skip
    assert rewards[0] == 0 and stats["episodes_truncated"] == 1 and ro.finish_reason[0] == LENGTH
    # A budget of 6 tokens: the prompt (4) and turn 1 (2) fill it; no observation follows.
    runner, _, generate = _runner(retry_env, ["9", "3"], "task.max_episode_tokens=6")
    ro, _, stats = runner.run(None, [{"question": "1+2", "answer": 3}], KEY,
                              sampling=None, repeat=1)  # fmt: skip
    assert stats["episodes_truncated"] == 1 and ro.lengths[0] == 2 and generate.calls == 1


@pytest.mark.parametrize("fail_on", ["reset", "step", "hang"])
def test_an_environment_that_fails_ends_its_episode_with_reward_zero_counted(retry_env, fail_on):
    runner, _, _ = _runner(retry_env, ["3"] * 3, "task.env_timeout=0.5", fail_on=fail_on)
    examples = [{"question": "1+2", "answer": 3}, {"question": "2+2", "answer": 4}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro, rewards, stats = runner.run(None, examples, KEY, sampling=None, repeat=2)
    assert stats["env_errors"] == 4 and not rewards.any()
    assert ro.completion_tokens.shape[0] == 4
    assert len(caught) == 1  # the first failure is logged, the rest counted


def test_observations_continue_the_conversation_as_the_chat_template_renders_it():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<|im_end|>": 1},
                                                               unk_token="<unk>"))  # fmt: skip
    backend.add_special_tokens(["<|im_end|>"])
    template = ChatTemplate(QWEN25, special_tokens={"eos_token": "<|im_end|>"})
    tok = Tokenizer(backend, eos_ids=[1], pad_id=0, chat_template=template)
    obs = Observations(tok)
    first, after = obs.first("What is 2+2?"), obs.after_turn("wrong, try again")
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
