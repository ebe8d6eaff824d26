"""Chat templates (models/chat.py) against transformers' renderings of published templates.

expected.json is written by tests/fixtures/chat_templates/make_expected.py with transformers'
own `apply_chat_template`; these tests need jinja2 only.
"""

import datetime as dt
import json
import shutil
from pathlib import Path

import pytest
from conftest import HF_FIXTURES

from jaxrl_scale.models.chat import ChatTemplate, load_chat_template, special_tokens
from jaxrl_scale.models.hf import CheckpointError, load_tokenizer
from jaxrl_scale.models.tokenizer import CharTokenizer

HERE = Path(__file__).parent / "fixtures" / "chat_templates"
EXPECTED = json.loads((HERE / "expected.json").read_text(encoding="utf-8"))
CLOCK = dt.datetime.fromisoformat(EXPECTED["clock"])


def _template(key: str) -> ChatTemplate:
    spec = EXPECTED["templates"][key]
    text = (HERE / spec["file"]).read_text(encoding="utf-8")
    return ChatTemplate(text, special_tokens=spec["special_tokens"], clock=lambda: CLOCK)


TEMPLATES = {key: _template(key) for key in EXPECTED["templates"]}


@pytest.mark.parametrize(
    "case", EXPECTED["cases"], ids=[f"{c['template']}:{c['name']}" for c in EXPECTED["cases"]]
)
def test_render_equals_transformers(case):
    text = TEMPLATES[case["template"]].render(
        case["messages"],
        tools=case["tools"],
        add_generation_prompt=case["add_generation_prompt"],
        **case["extra"],
    )
    assert text == case["expected"]


def test_fixtures_cover_the_brief():
    names = {(c["template"], c["name"].split("/")[0]) for c in EXPECTED["cases"]}
    for key in ("qwen2.5", "qwen3", "llama3.2"):
        assert {(key, "system_user"), (key, "tool_call_and_response")} <= names
    assert ("qwen3", "thinking_history") in names and ("llama3.2", "strftime_now") in names
    assert {c["add_generation_prompt"] for c in EXPECTED["cases"]} == {True, False}


def test_strftime_now_reads_the_clock_and_tojson_keeps_unicode():
    template = ChatTemplate(
        "{{ strftime_now('%Y-%m-%d') }} {{ x | tojson }} {{ x | tojson(indent=2) }}",
        clock=lambda: dt.datetime(2025, 1, 2),
    )
    out = template.render([{"role": "user", "content": "hi"}], x={"a": "<é>"})
    assert out == '2025-01-02 {"a": "<é>"} {\n  "a": "<é>"\n}'


def test_named_templates_pick_tool_use_given_tools():
    template = ChatTemplate({"default": "plain", "tool_use": "tools: {{ tools | length }}"})
    chat = [{"role": "user", "content": "hi"}]
    assert template.render(chat) == "plain"
    assert template.render(chat, tools=[{"name": "f"}]) == "tools: 1"
    with pytest.raises(ValueError, match="none named 'default'"):
        ChatTemplate({"a": "x", "b": "y"}).render(chat)


def test_bad_template_names_its_file(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("hello\n{% if messages %}unclosed")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: line 2: .*endif"):
        load_chat_template(tmp_path)


def test_raise_exception_becomes_value_error():
    chat = [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}] * 2}]
    with pytest.raises(ValueError, match="only supports single tool-calls at once"):
        TEMPLATES["llama3.2"].render(chat)


def test_bad_messages_are_named():
    template = TEMPLATES["qwen2.5"]
    with pytest.raises(ValueError, match="message 1 has no 'content'"):
        template.render([{"role": "user", "content": "a"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="message 0 has no 'role'"):
        template.render([{"content": "a"}])
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    with pytest.raises(TypeError, match="list of dicts"):
        template.render("hello")
    with pytest.raises(TypeError, match=r"message 0\['content'\]: a object"):
        template.render([{"role": "user", "content": object()}])


def test_sandbox_refuses_python_internals():
    chat = [{"role": "user", "content": ""}]
    with pytest.raises(ValueError, match="SecurityError"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(chat)
    with pytest.raises(ValueError, match="SecurityError: namespace attribute '_x'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(chat)
    with pytest.raises(ValueError, match="SecurityError"):  # the arguments are immutable
        ChatTemplate("{{ messages.append(1) }}").render(chat)


def test_checkpoint_folder_template_and_special_tokens(tmp_path):
    shutil.copytree(HF_FIXTURES / "qwen2", tmp_path, dirs_exist_ok=True)
    assert load_tokenizer(tmp_path).chat_template is None
    with pytest.raises(ValueError, match="no chat template.*tokenizer_config.json"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])

    spec = EXPECTED["templates"]["llama3.2"]
    config = {
        "bos_token": {"content": "<|begin_of_text|>", "special": True},
        "eos_token": "<|eot_id|>",
        "chat_template": [
            {"name": "default", "template": (HERE / spec["file"]).read_text()},
            {"name": "other", "template": "x"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert special_tokens(tmp_path) == spec["special_tokens"]
    tok = load_tokenizer(tmp_path)
    case = next(c for c in EXPECTED["cases"] if c["template"] == "llama3.2")
    text = tok.apply_chat_template(
        case["messages"], add_generation_prompt=case["add_generation_prompt"], **case["extra"]
    )
    assert text == case["expected"]

    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    tok = load_tokenizer(tmp_path)  # the .jinja file wins over tokenizer_config.json
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>hi"

    out = tmp_path / "saved"
    out.mkdir()
    tok.save(out)
    again = load_chat_template(out)
    assert again.templates == tok.chat_template.templates
    assert again.special_tokens == spec["special_tokens"]

    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(CheckpointError, match="chat_template.jinja: line 1"):
        load_tokenizer(tmp_path)


def test_char_tokenizer_has_no_template():
    with pytest.raises(ValueError, match="no chat template"):
        CharTokenizer("ab").apply_chat_template([{"role": "user", "content": "a"}])


def test_inputs_become_plain_data():
    import enum

    import numpy as np

    class Colour(str, enum.Enum):
        RED = "red"

    message = {"role": "user", "content": Colour.RED, "name": None}
    template = ChatTemplate("{{ messages[0].content }} {{ messages[0].name is defined }} {{ n }}")
    assert template.render([message], n=np.int64(3)) == "red False 3"
    assert message["name"] is None  # the caller's message is left as it was


def test_template_pickles_for_worker_processes():
    import pickle

    spec = EXPECTED["templates"]["qwen2.5"]
    text = (HERE / spec["file"]).read_text(encoding="utf-8")
    template = ChatTemplate(text, special_tokens=spec["special_tokens"])  # the default clock
    template = pickle.loads(pickle.dumps(template))
    case = next(c for c in EXPECTED["cases"] if c["template"] == "qwen2.5")
    out = template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert out == case["expected"]
