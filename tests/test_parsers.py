"""A turn's thinking, content and tool calls (models/parsers.py): hand-written turns, the
published chat templates' own renderings of calls read back, and the stream parser against
the whole-text parser at every split point."""

import json
import random
from pathlib import Path

import pytest
import tokenizers

from jaxrl_scale.models import parsers
from jaxrl_scale.models.chat import ChatTemplate
from jaxrl_scale.models.parsers import (
    MalformedCall,
    StreamParser,
    ToolCall,
    parse,
    parse_tool_calls,
    prompt_opens_think,
    split_reasoning,
    tool_family,
)
from jaxrl_scale.models.tokenizer import Tokenizer
from jaxrl_scale.tasks.scoring import strip_think
from jaxrl_scale.tasks.tools import ToolEnv
from jaxrl_scale.tasks.workers import WorkerPool

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIAL = {
    "qwen2.5": {"eos_token": "<|im_end|>"},
    "qwen3": {"eos_token": "<|im_end|>"},
    "llama3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}
# Where a rendered conversation's last assistant turn starts and ends, per template.
TURN = {
    "qwen2.5": ("<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3.2": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}


def call(name, **arguments):
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


# --------------------------------------------------------------------------- reasoning


def test_a_think_block_is_split_from_the_content():
    assert split_reasoning("<think>\n2+2=4\n</think>\n\n4") == ("\n2+2=4\n", "\n\n4")
    assert split_reasoning("  <think>a</think>b") == ("a", "b")  # leading whitespace aside
    assert split_reasoning("no tags") == (None, "no tags")
    assert split_reasoning("") == (None, "")
    assert split_reasoning("<think>a</think>b</think>c") == ("a", "b</think>c")  # the first close
    assert split_reasoning("<think>a</think>b<think>c") == ("a", "b<think>c")  # one block only


def test_an_unclosed_block_is_all_reasoning():
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("<think>") == ("", "")


def test_a_block_the_prompt_opened_thinks_from_the_first_character():
    assert split_reasoning("2+2=4</think>4") == ("2+2=4", "4")  # inferred from the bare close
    assert split_reasoning("x<think>a</think>b") == ("x<think>a", "b")  # not at the start
    assert split_reasoning("x <think> y") == ("x <think> y", "")
    assert split_reasoning("still thinking", opened=True) == ("still thinking", "")
    assert split_reasoning("2+2=4</think>4", opened=False) == (None, "2+2=4</think>4")
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def _old_strip_think(text):  # tasks/scoring.py's before it used split_reasoning
    close = text.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>") :]
    return None if "<think>" in text else text


def test_strip_think_is_unchanged_on_any_mix_of_tags():
    pieces = ["<think>", "</think>", "a", " ", "\n", "<", "think>", "</"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
        assert strip_think(text) == _old_strip_think(text), text


# --------------------------------------------------------------------------- hermes


def test_hermes_calls_in_order_with_the_text_around_them():
    text = (
        'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add. \n done"
    assert calls == [call("add", a=2, b=3), call("add", a=1)]  # a string's object, too
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_hermes_malformed_calls_say_why_in_their_place():
    bad = [
        "<tool_call>{not json}</tool_call>",
        "<tool_call>[1]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
    ]
    good = '<tool_call>{"name": "f"}</tool_call>'  # no arguments: {}
    content, calls = parse_tool_calls(bad[0] + good + "".join(bad[1:]))
    assert content == "" and calls[1] == ToolCall("f", "{}")
    errors = [c for c in calls if isinstance(c, MalformedCall)]
    assert [c.text for c in errors] == bad
    assert errors[0].error.startswith("the tool call is not JSON (")
    assert (
        errors[1].error == errors[2].error == 'a tool call needs {"name": ..., "arguments": {...}}'
    )
    assert errors[3].error == errors[4].error == "add: the arguments must be a JSON object"


def test_hermes_braces_and_tags_inside_strings_and_an_unclosed_call():
    code = 'def f():\n    return {"a": "}"}  # </tool_call'
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    text = f"<tool_call>{body}</tool_call>"
    assert parse_tool_calls(text) == ("", [call("python", code=code)])
    unclosed = 'Sure. <tool_call>{"name": "add", "arguments": {}}'
    assert parse_tool_calls(unclosed) == (unclosed, [])  # content, as written


def test_reasoning_and_calls_and_calls_written_while_thinking():
    text = (
        '<think>maybe <tool_call>{"name": "no"}</tool_call></think>\n\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    parsed = parse(text)
    assert parsed.reasoning == 'maybe <tool_call>{"name": "no"}</tool_call>'
    assert parsed.content == "\n\n" and parsed.calls == [call("add", a=1)]
    assert parse('<think>still <tool_call>{"name": "add"}</tool_call>').calls == []


# --------------------------------------------------------------------------- llama3


def test_llama3_calls_with_and_without_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
    assert parse_tool_calls(one, "llama3") == ("", [call("get_weather", city="Zürich")])
    assert parse_tool_calls("<|python_tag|>" + one, "llama3")[1] == [
        call("get_weather", city="Zürich")
    ]
    assert parse_tool_calls('\n { "name": "f", "arguments": "{}"}', "llama3")[1] == [call("f")]
    two = (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "{;}"}};'
    )
    assert parse_tool_calls(two, "llama3")[1] == [call("a"), call("b", x="{;}")]
    assert parse_tool_calls("It is 21 °C.", "llama3") == ("It is 21 °C.", [])
    assert parse_tool_calls('{"answer": 4}', "llama3") == ('{"answer": 4}', [])  # not a call
    assert parse('<think>hm</think>\n{"name": "f", "parameters": {}}', "llama3").calls == [
        call("f")
    ]


def test_llama3_malformed_calls():
    _, calls = parse_tool_calls('{"name": "f", "parameters": {"x": 1}', "llama3")
    assert len(calls) == 1 and calls[0].error.startswith("the tool call is not JSON (")
    _, calls = parse_tool_calls('{"name": "f", "parameters": {}} and then some words', "llama3")
    assert calls[0] == call("f") and calls[1] == MalformedCall(
        "and then some words", "text after a tool call (separate calls by ;)"
    )
    _, calls = parse_tool_calls('<|python_tag|>{"name": 3}', "llama3")
    assert calls[0].error == 'a tool call needs {"name": ..., "parameters": {...}}'
    assert parse_tool_calls("<|python_tag|>", "llama3")[1][0].error == "the tool call is empty"
    with pytest.raises(ValueError, match="unknown tool call family 'mistral'"):
        parse_tool_calls("", "mistral")


# --------------------------------------------------------------------------- templates


def _template(name):
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), special_tokens=SPECIAL[name])


def _assistant_turn(name, message):
    """The assistant turn `message` as the template renders it, end token cut off."""
    messages = [{"role": "user", "content": "How warm is it in Zürich?"}, message]
    text = _template(name).render(messages, add_generation_prompt=False, date_string="1 Jan 2025")
    start, end = TURN[name]
    turn = text[text.rindex(start) + len(start) :]
    return turn[: turn.index(end)]


def _calls(*arguments):
    return [{"type": "function", "function": {"name": "get_weather", "arguments": a}}
            for a in arguments]  # fmt: skip


ARGUMENTS = [
    {"city": "Zürich"},
    {"city": 'Say "{hi}"', "days": [1, 2], "opts": {"unit": "°C", "deep": {"x": None}}},
]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("as_string", [False, True])
def test_qwen_templates_calls_read_back(name, as_string):
    arguments = [json.dumps(a) if as_string else a for a in ARGUMENTS]
    message = {"role": "assistant", "content": "Checking.", "tool_calls": _calls(*arguments)}
    if name == "qwen3":
        message["reasoning_content"] = "The user wants {weather}."
    turn = _assistant_turn(name, message)
    assert tool_family(_template(name)) == "hermes"
    parsed = parse(turn, "hermes")
    assert [c.name for c in parsed.calls] == ["get_weather"] * 2
    assert [json.loads(c.arguments) for c in parsed.calls] == ARGUMENTS
    assert parsed.content.strip() == "Checking."
    assert parsed.reasoning == ("\nThe user wants {weather}.\n" if name == "qwen3" else None)


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_llama_template_calls_read_back(arguments):
    turn = _assistant_turn("llama3.2", {"role": "assistant", "tool_calls": _calls(arguments)})
    assert turn.startswith('{"name": "get_weather", "parameters": ')
    assert tool_family(_template("llama3.2")) == "llama3"
    parsed = parse(turn, "llama3")
    assert parsed == parse(turn, tool_family(_template("llama3.2")))
    assert parsed.content == "" and [json.loads(c.arguments) for c in parsed.calls] == [arguments]


def test_tool_family_reads_a_tokenizer_and_template_text():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok = Tokenizer(backend, eos_ids=[0], chat_template=_template("llama3.2"))
    assert tool_family(tok) == "llama3"
    assert tool_family(Tokenizer(backend, eos_ids=[0])) == "hermes"  # no template
    assert tool_family("{{ '<|python_tag|>' }}") == "llama3"
    assert tool_family("{{ messages }}") == "hermes"


# --------------------------------------------------------------------------- streaming

TURNS = [
    "",
    "  plain answer < with > signs <tool_cal",
    "<think>\n2+2=4\n</think>\n\n4",
    " \n<think>a</think>b</think>c<think>",
    "<think>still <tool_call>thinking",
    "2+2=4</think>4",
    "x<think>a</think>b",
    "<thin",
    "<",
    "Let me add. <tool_call>\n"
    '{"name": "add", "arguments": {"a": 2, "b": "}</tool_call"}}\n</tool_call>'
    '\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done',
    '<tool_call>{bad}</tool_call><tool_call><tool_call>{"name": "f"}</tool_call><tool_call>{',
    '<think>plan</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><<',
    '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
    '\n<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "{;}"}}',
    '<think>hm</think>\n {\n"name": "f", "parameters": {}} trailing',
    '{"answer": "<think>"}',
    "{",
    "<|python_tag|>",
    "<|python",
]


def _rendered_turns():
    two = {"role": "assistant", "content": "Checking.", "tool_calls": _calls(*ARGUMENTS)}
    thinking = {**two, "reasoning_content": "The user wants {weather}."}
    one = {"role": "assistant", "tool_calls": _calls(ARGUMENTS[1])}
    return [_assistant_turn("qwen2.5", two), _assistant_turn("qwen3", thinking),
            _assistant_turn("llama3.2", one)]  # fmt: skip


def _stream(text, cuts, family, opened):
    parser = StreamParser(family, opened=opened)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return (
        "".join(d.reasoning for d in deltas),
        "".join(d.content for d in deltas),
        [c for d in deltas for c in d.calls],
    )


def _whole(text, family, opened):
    parsed = parse(text, family, opened=opened)
    return parsed.reasoning or "", parsed.content, parsed.calls


@pytest.mark.parametrize("family", ["hermes", "llama3"])
def test_the_stream_gives_the_whole_texts_parse_at_every_split(family):
    rng = random.Random(0)
    for text in TURNS + _rendered_turns():
        inferred = split_reasoning(text)[0] is not None and not text.lstrip().startswith("<think>")
        for opened in (False, True):
            want = _whole(text, family, opened)
            if opened == inferred:
                assert want == _whole(text, family, None)
            chunkings = [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]
            chunkings += [sorted(rng.sample(range(len(text) + 1), rng.randrange(len(text) + 1)))
                          for _ in range(30)]  # fmt: skip
            for cuts in chunkings:
                assert _stream(text, cuts, family, opened) == want, (text, cuts, opened)


def test_the_stream_holds_back_only_what_may_be_a_marker():
    parser = StreamParser("hermes")
    assert parser.feed(" <thi").content == ""  # may open a think block
    assert parser.feed("nk>plan</th").reasoning == "plan"
    assert parser.feed("ink>The answer <to").content == "The answer "
    delta = parser.feed('ol_call>{"name": "f"}</tool_call>!')
    assert delta.calls == (ToolCall("f", "{}"),) and delta.content == "!"
    llama = StreamParser("llama3")
    assert llama.feed(" {").content == "" and llama.feed(' "x').content == ' { "x'


@pytest.mark.parametrize("family", ["hermes", "llama3"])
def test_the_stream_matches_on_random_mixes_of_markers(family):
    parts = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "<", "</",
             "{", "}", ";", " ", "\n", "a", '"name"', ': "f"', '{"name": "f", "parameters": {}}',
             '{"name": "g", "arguments": {"x": 1}}']  # fmt: skip
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(10)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(len(text) + 1)))
        for opened in (False, True):
            assert _stream(text, cuts, family, opened) == _whole(text, family, opened), text


# --------------------------------------------------------------------------- tool episodes


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_a_llama3_tool_episode_reads_its_calls():
    pool = WorkerPool(1)
    env = ToolEnv({"prompt": "2+3?"}, [add], lambda c, e: float(c.strip() == "5"), pool=pool,
                  family="llama3")  # fmt: skip
    obs, reward, done = env.step('{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "x"}')
    assert [m["content"] for m in obs] == ["5", "error: no tool named 'x' (tools: add)"]
    assert not done and env.tool_errors == 1
    assert env.step("<think>2+3=5</think>5") == (None, 1.0, True)
    with pytest.raises(ValueError, match="unknown tool call family"):
        ToolEnv({"prompt": "x"}, [add], None, pool=pool, family="llama")


@pytest.mark.parametrize("family", ["hermes", "llama3"])
def test_a_stream_without_calls_gives_the_content_as_generated(family):
    # No tools offered: call-shaped text is content, byte for byte, in any chunking.
    text = '<think>hm</think>{"name": "Bob",  "age": 3} <tool_call>{"name": "é"}</tool_call>'
    for cut in range(len(text) + 1):
        parser = StreamParser(family, calls=False)
        first, last = parser.feed(text[:cut]), parser.feed(text[cut:])
        end = parser.finish()
        assert first.content + last.content + end.content == text[len("<think>hm</think>") :]
        assert first.reasoning + last.reasoning + end.reasoning == "hm"
        assert not (first.calls or last.calls or end.calls)


def test_a_forced_calls_opening_and_the_models_rest_parse_as_one_call():
    """What a server forcing a call gives (the opening) and what the model writes after it
    read as the call, in each family; a name that needs escaping stays one JSON string."""
    rest = {"hermes": '{"a": 1}}\n</tool_call>', "llama3": '{"a": 1}}'}
    for family in parsers.FAMILIES:
        text = parsers.call_opening(family, 'odd"name') + rest[family]
        assert parsers.parse(text, family).calls == [parsers.ToolCall('odd"name', '{"a": 1}')]
        unnamed = parsers.call_opening(family) + 'add", "arguments": ' + rest[family]
        assert parsers.parse(unnamed, family).calls == [parsers.ToolCall("add", '{"a": 1}')]
