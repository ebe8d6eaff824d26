"""Text <-> token ids: one interface over HF `tokenizer.json` files and the built-in char tokenizer.

Both are a `tokenizers.Tokenizer` underneath, so both save to and load from `tokenizer.json`. A
checkpoint's tokenizer may also carry its chat template (models/chat.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from jaxrl_scale.models.chat import ChatTemplate

CHAR_SPECIALS = ("<pad>", "<eos>")


class Tokenizer:
    """`encode(text) -> ids`, `decode(ids) -> text`, plus the special ids a sampler needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_ids: Sequence[int],
        pad_id: int | None = None,
        bos_id: int | None = None,
        chat_template: ChatTemplate | None = None,
    ):
        if not eos_ids:
            raise ValueError("tokenizer needs at least one end-of-sequence id")
        self.backend = backend
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id = self.eos_ids[0] if pad_id is None else int(pad_id)
        self.bos_id = bos_id
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The conversation rendered with the checkpoint's chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` renders it (see `ChatTemplate.render`)."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template: its checkpoint folder has no "
                "chat_template.jinja and no 'chat_template' in tokenizer_config.json"
            )
        return self.chat_template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra
        )

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` into folder `path`, and the chat template when there is one."""
        self.backend.save(str(Path(path) / "tokenizer.json"))
        if self.chat_template is not None:
            self.chat_template.save(path)
            config = Path(path) / "tokenizer_config.json"
            if self.chat_template.special_tokens and not config.exists():
                config.write_text(json.dumps(self.chat_template.special_tokens, indent=2))


class CharTokenizer(Tokenizer):
    """One token per character of a fixed alphabet, for the built-in synthetic tasks.

    Ids: 0 `<pad>`, 1 `<eos>`, then the alphabet in order. Encoding a character outside the
    alphabet is an error naming it (never a silent unknown token).
    """

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        vocab = {tok: i for i, tok in enumerate((*CHAR_SPECIALS, *alphabet))}
        backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens(list(CHAR_SPECIALS))
        super().__init__(backend, eos_ids=[1], pad_id=0)
        self.alphabet = alphabet

    def encode(self, text: str) -> list[int]:
        for i, ch in enumerate(text):
            if ch not in self.alphabet:
                raise ValueError(f"character {ch!r} at index {i} is not in the tokenizer alphabet")
        return super().encode(text)
