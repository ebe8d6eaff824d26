"""A model turn's text as its parts: the thinking, the content, the tool calls, per model family.

    parsed = parse(text, family=tool_family(tokenizer))   # Parsed(reasoning, content, calls)

One place for both readers of a turn: the tool environments (tasks/tools.py) and the server.

Thinking (Qwen3, DeepSeek-R1). A turn that starts with `<think>` (leading whitespace aside)
thinks until the first `</think>`; the text after it is the content. Some templates open the
block in the prompt (the generation prompt ends with `<think>`, `prompt_opens_think`): the
turn then thinks from its first character. Given only the turn, a turn that has a think tag
anywhere but does not start with `<think>` is taken to be such a turn. A block that never
closes is all thinking, the content empty. Later tags are content, as written.

Tool calls, in the content only (a call written while thinking is not made), by family:
- "hermes" (Qwen2.5, Qwen3, Hermes): each `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` block, several per turn; the content is the text between the blocks, as
  written. A `<tool_call>` that never closes is content.
- "llama3" (Llama-3.1/3.2 JSON calls): a content that starts (leading whitespace aside) with
  `<|python_tag|>`, or with `{` and then `"name"`, is all calls: JSON objects
  `{"name": ..., "parameters": {...}}` ("arguments" also read), separated by `;`; its content
  is empty. Any other content has no calls.
A call's arguments may come as an object or as a JSON string holding one; `ToolCall.arguments`
is the object's JSON text (as OpenAI's schema has it). A call that cannot be read is a
`MalformedCall` in its place, its `error` written for the model to read.

Streaming. `StreamParser` takes the text as it is generated and gives each piece's thinking,
content and finished calls: it holds back only what may still become a marker (the start of
`<think>`, `</think>`, `<tool_call>`), a hermes call until its `</tool_call>`, the start of a
llama3 content until it is known to be calls or not, and a llama3 call turn until `finish()`.
Fed any chunking of a text it gives the pieces of `parse(text, opened=...)`, joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FAMILIES = ("hermes", "llama3")
_HERMES_BLOCK = re.compile(re.escape(TOOL_OPEN) + "(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
_LLAMA_HEAD = re.compile(r'\{\s*"name"')


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call as OpenAI's schema has it: `arguments` is a JSON object's text."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A call that could not be read: its text as generated and why, for the model to read."""

    text: str
    error: str


Call = ToolCall | MalformedCall


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A whole turn: `reasoning` is None when the turn has no think block."""

    reasoning: str | None
    content: str
    calls: list[Call]


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one piece of a streamed turn adds: thinking, content, the calls it finished."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[Call, ...] = ()


def tool_family(source: Any) -> str:
    """The tool call family of a chat template (its text, a ChatTemplate, or a Tokenizer):
    "hermes" for templates that write `<tool_call>`, "llama3" for those that ask for
    `"parameters"` JSON or `<|python_tag|>`, "hermes" otherwise."""
    template = getattr(source, "chat_template", source)  # a Tokenizer's, None when it has none
    if template is None:
        return "hermes"
    text = template if isinstance(template, str) else "\n".join(template.templates.values())
    if TOOL_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or '"parameters"' in text:
        return "llama3"
    return "hermes"


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered prompt leaves a think block open (DeepSeek-R1, Qwen3 thinking-only
    templates end the generation prompt with `<think>`): its turn thinks from the start."""
    return prompt.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, *, opened: bool | None = None) -> tuple[str | None, str]:
    """(reasoning, content) of a turn; reasoning None when there is no think block.

    Args:
      text: the turn as generated.
      opened: whether the prompt opened the block (`prompt_opens_think`); None: inferred from
        the text (a think tag anywhere, and no `<think>` at its start).
    """
    if opened is None:
        tagged = THINK_OPEN in text or THINK_CLOSE in text
        opened = tagged and not text.lstrip().startswith(THINK_OPEN)
    if opened:
        body = text
    else:
        start = text.lstrip()
        if not start.startswith(THINK_OPEN):
            return None, text
        body = start[len(THINK_OPEN) :]
    reasoning, _, content = body.partition(THINK_CLOSE)  # unclosed: all of it is reasoning
    return reasoning, content


def parse_tool_calls(text: str, family: str = "hermes") -> tuple[str, list[Call]]:
    """(content, calls) of a turn's content (no thinking in it; see `parse`): the text
    outside the calls and the calls in order, unreadable ones as MalformedCall."""
    check_family(family)
    if family == "llama3":
        calls = _llama_turn(text)
        return (text, []) if calls is None else ("", calls)
    pieces, calls, end = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        pieces.append(text[end : match.start()])
        calls.append(_hermes_call(match.group(0), match.group(1)))
        end = match.end()
    return "".join(pieces) + text[end:], calls


def parse(text: str, family: str = "hermes", *, opened: bool | None = None) -> Parsed:
    """A whole turn: its thinking split off (`split_reasoning`), then its content's calls."""
    reasoning, content = split_reasoning(text, opened=opened)
    content, calls = parse_tool_calls(content, family)
    return Parsed(reasoning, content, calls)


class StreamParser:
    """`parse` for a turn that arrives in pieces (see the module's docstring):

        parser = StreamParser(family, opened=prompt_opens_think(prompt))
        for piece in pieces:
            delta = parser.feed(piece)   # Delta(reasoning, content, calls)
        delta = parser.finish()          # what was held back

    `opened` must be what `parse` would take (given or inferred) for the pieces to join into
    its result: a stream cannot infer it, having sent the start before the text shows it.
    """

    def __init__(self, family: str = "hermes", *, opened: bool = False, calls: bool = True):
        self.family = check_family(family)
        self.calls = calls  # False (no tools offered): after the thinking, all is content
        self._state = "think" if opened else "start"
        self._held = ""  # received, not yet given out

    def feed(self, text: str) -> Delta:
        self._held += text
        return self._advance(final=False)

    def finish(self) -> Delta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> Delta:
        """Give out what the held text decides, moving through the states:
        start -> think -> content -> (hermes) call -> content ..., or (llama3) content ->
        plain | calls."""
        reasoning, content, calls = [], [], []
        while True:
            held, state = self._held, self._state
            if state == "start":  # whitespace or a beginning of "<think>" so far
                start = held.lstrip()
                if start.startswith(THINK_OPEN):
                    self._state, self._held = "think", start[len(THINK_OPEN) :]
                elif THINK_OPEN.startswith(start) and not final:
                    break
                else:
                    self._state = "content"
            elif state == "think":
                before, closed, after = held.partition(THINK_CLOSE)
                if closed:
                    reasoning.append(before)
                    self._state, self._held = "content", after
                    continue
                reasoning.append(self._give(THINK_CLOSE, final))
                break
            elif state == "content" and not self.calls:
                self._state = "plain"
            elif state == "content" and self.family == "hermes":
                before, opened, after = held.partition(TOOL_OPEN)
                if opened:
                    content.append(before)
                    self._state, self._held = "call", opened + after
                    continue
                content.append(self._give(TOOL_OPEN, final))
                break
            elif state == "call":
                end = held.find(TOOL_CLOSE)
                if end >= 0:
                    end += len(TOOL_CLOSE)
                    calls.append(
                        _hermes_call(held[:end], held[len(TOOL_OPEN) : end - len(TOOL_CLOSE)])
                    )
                    self._state, self._held = "content", held[end:]
                    continue
                if final:  # never closed: content, as written
                    content.append(held)
                    self._held = ""
                break
            elif state == "content":  # llama3: calls or not, once the start shows it
                head = _llama_head(held.lstrip())
                if head is None and not final:
                    break
                self._state = "calls" if head else "plain"
            elif state == "plain":
                content.append(held)
                self._held = ""
                break
            else:  # "calls": the whole content is calls, read at the end
                if final:
                    calls.extend(_llama_turn(held) or [])
                    self._held = ""
                break
        return Delta("".join(reasoning), "".join(content), tuple(calls))

    def _give(self, marker: str, final: bool) -> str:
        """The held text but for an end that may be the start of `marker`, which stays held."""
        keep = 0 if final else _partial(self._held, marker)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out


def call_opening(family: str, name: str | None = None) -> str:
    """The text a turn's first call begins with, in `family`'s format, up to the function's
    name (`name` None: the model writes it) or, with `name`, up to its arguments. A server
    that must call a tool (OpenAI's tool_choice "required" or a named function) starts the
    answer with it; the model writes the rest, and `parse` reads the opening and the rest as
    one turn."""
    head = {"hermes": TOOL_OPEN + '\n{"name": "', "llama3": '{"name": "'}[check_family(family)]
    if name is None:
        return head
    key = "arguments" if family == "hermes" else "parameters"
    return head + json.dumps(name)[1:-1] + f'", "{key}": '


def check_family(family: str) -> str:
    """`family`, or a ValueError naming the known ones."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tool call family {family!r} (known: {', '.join(FAMILIES)})")
    return family


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker`, shorter than it."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call(obj: Any, text: str, keys: tuple[str, ...]) -> Call:
    """A decoded call object: `name` and its arguments under the first of `keys` present."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall(text, f'a tool call needs {{"name": ..., "{keys[0]}": {{...}}}}')
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return MalformedCall(text, f"{obj['name']}: the arguments must be a JSON object")
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes_call(block: str, body: str) -> Call:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(block, f"the tool call is not JSON ({e.msg})")
    return _call(obj, block, ("arguments",))


def _llama_head(start: str) -> bool | None:
    """Whether a llama3 content (its leading whitespace cut) is calls; None: not known yet."""
    if start.startswith(PYTHON_TAG) or _LLAMA_HEAD.match(start):
        return True
    if PYTHON_TAG.startswith(start):
        return None
    if start.startswith("{") and '"name"'.startswith(start[1:].lstrip()):
        return None
    return False


def _llama_turn(text: str) -> list[Call] | None:
    """The calls of a llama3 content, None when it is not a call turn."""
    start = text.lstrip()
    if not _llama_head(start):
        return None
    body = start.removeprefix(PYTHON_TAG)
    decoder, calls, i = json.JSONDecoder(), [], _skip_space(body, 0)
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            calls.append(MalformedCall(body[i:], f"the tool call is not JSON ({e.msg})"))
            break
        calls.append(_call(obj, body[i:end], ("parameters", "arguments")))
        i = _skip_space(body, end)
        if i < len(body) and body[i] != ";":
            calls.append(MalformedCall(body[i:], "text after a tool call (separate calls by ;)"))
            break
        i = _skip_space(body, i + 1)
    if not calls:
        calls.append(MalformedCall(start, "the tool call is empty"))
    return calls


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
