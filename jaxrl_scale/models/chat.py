"""Checkpoints' chat templates, rendered as Hugging Face transformers' `apply_chat_template` does.

A template is Jinja source shipped with a checkpoint (`chat_template.jinja`, or the
`chat_template` entry of `tokenizer_config.json`). It renders in a sandboxed, immutable Jinja
environment with transformers' settings (trim_blocks, lstrip_blocks, loop controls) and helpers
(`raise_exception`, a `tojson` that neither escapes HTML nor ASCII, `strftime_now`), and sees the
variables transformers passes: `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special token strings (`bos_token`, `eos_token`, ...) and any extra keyword.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"  # NAME.jinja beside the default, as transformers
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may come under; transformers fills the first two from any of them.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(Exception):
    """`raise_exception(message)` called by a template; render turns it into a ValueError."""


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names that would reach Python internals."""

    def __init__(
        *args: Any, **kwargs: Any
    ):  # first positional is self, as in jinja2.utils.Namespace
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} starts with '_'")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to mark
    assistant tokens; rendering is unchanged by it)."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment(clock: Callable[[], datetime]) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A checkpoint's chat template (one Jinja source, or several by name) with its special tokens.

    Args:
      template: Jinja source, or a mapping name -> source (as `tokenizer_config.json` lists them):
        "tool_use" renders calls given `tools` when present, "default" the others.
      special_tokens: the tokenizer's `bos_token`, `eos_token`, ... strings, seen by the template.
      source: where the template came from (a file), named in errors.
      clock: what `strftime_now` reads; pass a fixed time to pin dates (tests, reproducible runs).
    """

    def __init__(
        self,
        template: str | Mapping[str, str],
        *,
        special_tokens: Mapping[str, str] | None = None,
        source: str = "chat template",
        clock: Callable[[], datetime] = datetime.now,
    ):
        sources = {"default": template} if isinstance(template, str) else dict(template)
        if not sources:
            raise ValueError(f"{source}: no templates given")
        self.templates = sources
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self.clock = clock
        self._compile_all()

    def _compile_all(self) -> None:
        env = _environment(self.clock)
        self._compiled = {n: self._compile(env, n, t) for n, t in self.templates.items()}

    def __getstate__(self) -> dict[str, Any]:  # compiled templates do not pickle; sources do
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compile_all()

    def _where(self, name: str) -> str:
        return self.source if len(self.templates) == 1 else f"{self.source} (template {name!r})"

    def _compile(self, env: jinja2.Environment, name: str, text: Any) -> jinja2.Template:
        if not isinstance(text, str):
            raise ValueError(f"{self._where(name)}: the template is not a string: {text!r:.80}")
        try:
            return env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{self._where(name)}: line {e.lineno}: {e.message}") from None

    def pick(self, tools: Sequence | None = None) -> str:
        """The template's name transformers would use: "tool_use" given tools, else "default"."""
        if len(self.templates) == 1:
            return next(iter(self.templates))
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise ValueError(
            f"{self.source}: several chat templates and none named 'default' "
            f"({sorted(self.templates)})"
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The conversation as the checkpoint's prompt text, equal to transformers'
        `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
        tokenize=False, **extra)`.

        Messages are dicts with "role" and "content" ("content" may be left out of an assistant
        message that has "tool_calls"); keys whose value is None are dropped first, as
        transformers does. `extra` reaches the template as variables (e.g. `enable_thinking`,
        `date_string`) and wins over a special token of the same name.
        """
        name = self.pick(tools)
        chat = _checked_messages(messages, self._where(name))
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
                raise TypeError(f"tools must be a list of JSON-schema dicts, got {tools!r:.80}")
            tools = _plain(list(tools), "tools")
        variables = {**self.special_tokens, **_plain(extra, "extra")}
        try:
            return self._compiled[name].render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as e:
            raise ValueError(f"{self._where(name)}: {e}") from None
        except jinja2.TemplateError as e:
            raise ValueError(f"{self._where(name)}: {type(e).__name__}: {e}") from None

    def save(self, folder: str | Path) -> None:
        """Write chat_template.jinja (the default) and additional_chat_templates/NAME.jinja."""
        folder = Path(folder)
        for name, text in self.templates.items():
            if name == "default" or len(self.templates) == 1:
                (folder / TEMPLATE_FILE).write_text(text, encoding="utf-8")
            else:
                (folder / NAMED_TEMPLATES_DIR).mkdir(exist_ok=True)
                (folder / NAMED_TEMPLATES_DIR / f"{name}.jinja").write_text(text, encoding="utf-8")


def _checked_messages(messages: Sequence[Mapping[str, Any]], where: str) -> list[dict]:
    """Plain-data copies of the messages, None values dropped and reasoning keys aliased."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: messages must be a list of dicts, got {messages!r:.80}")
    if not messages:
        raise ValueError(f"{where}: cannot render an empty conversation")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"{where}: message {i} is not a dict: {message!r:.80}")
        message = {k: v for k, v in _plain(dict(message), f"message {i}").items() if v is not None}
        if "role" not in message:
            raise ValueError(f"{where}: message {i} has no 'role': {message!r:.120}")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"{where}: message {i} has no 'content': {message!r:.120}")
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:  # templates read "reasoning_content" (most) or "thinking"
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _plain(value: Any, where: str) -> Any:
    """A copy made of JSON-like types only, so a template reaches no object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only once numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item(), where)
    # Subclasses (enums, ...) become their base value, without their extra methods.
    for kind, base_value in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):
            return base_value(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(f"{where}: a {type(value).__name__} cannot go into a chat template")


def load_chat_template(
    folder: str | Path, *, clock: Callable[[], datetime] = datetime.now
) -> ChatTemplate | None:
    """A checkpoint folder's chat template with its special tokens, or None when it has none.

    Looked up as transformers does: `chat_template.jinja` (plus any
    additional_chat_templates/NAME.jinja) first, else `chat_template` in tokenizer_config.json
    (a string, or a list of {"name", "template"}).
    """
    folder = Path(folder)
    config = _tokenizer_config(folder)
    templates = {}
    if (folder / TEMPLATE_FILE).exists():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / NAMED_TEMPLATES_DIR).is_dir():
        for file in sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        only_default = list(templates) == ["default"]
        source = str(folder / TEMPLATE_FILE) if only_default else str(folder)
    else:
        source = f"{folder / 'tokenizer_config.json'} chat_template"
        raw = config.get("chat_template")
        if raw is None:
            return None
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list) and all(
            isinstance(t, Mapping) and {"name", "template"} <= t.keys() for t in raw
        ):
            templates = {t["name"]: t["template"] for t in raw}
        else:
            raise ValueError(f"{source}: neither a string nor a list of {{name, template}}")
    tokens = special_tokens(folder, config)
    return ChatTemplate(templates, special_tokens=tokens, source=source, clock=clock)


def special_tokens(folder: str | Path, config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The `bos_token`, `eos_token`, ... strings of tokenizer_config.json, with
    special_tokens_map.json filling the names it lacks."""
    folder = Path(folder)
    config = _tokenizer_config(folder) if config is None else config
    legacy_file = folder / "special_tokens_map.json"
    legacy = _read_json(legacy_file) if legacy_file.exists() else {}
    found = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = legacy.get(name) if value is None else value
        if isinstance(value, Mapping):  # a serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    file = folder / "tokenizer_config.json"
    return _read_json(file) if file.exists() else {}


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data
