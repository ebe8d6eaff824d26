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


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (printable bytes stand for themselves, the
    others for 256 and up, in order), inverted: character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {(chr(b) if b in kept else chr(next(extra))): b for b in range(256)}


BYTE_OF = _byte_level_alphabet()


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
        # Byte-level BPE (Qwen, Llama-3): each id decodes to bytes of its own, and a text is
        # their concatenation read as UTF-8 (a server's detokenizer appends a token's bytes
        # instead of decoding a window of ids twice per token: serve/text.py).
        self.byte_level = type(backend.decoder).__name__ == "ByteLevel"
        # id -> (bytes, special), filled as ids are met. Servers on several threads may share
        # it: each writer sets an item to the same value, and a dict item set is atomic.
        self._pieces: dict[int, tuple[bytes, bool]] = {}
        self._special: tuple[int, set[int]] = (-1, set())  # (vocabulary size, special ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int, *, skip_special_tokens: bool = True) -> bytes:
        """The bytes id `token` adds to a decoded text. For a byte-level tokenizer its
        characters' bytes (part of one UTF-8 character, maybe), a special token's none where
        `skip_special_tokens`; the bytes of any run of ids, read as UTF-8 with U+FFFD for
        what is not, are `decode` of the run. Otherwise the UTF-8 of the id's text alone."""
        token = int(token)
        known = self._pieces.get(token)
        if known is None:
            text = self.backend.id_to_token(token)
            if self.byte_level and text is not None and all(ch in BYTE_OF for ch in text):
                piece = bytes(BYTE_OF[ch] for ch in text)
            elif self.byte_level:  # a character outside the byte alphabet (an added
                # token's): the decoder reads the whole token as its UTF-8
                piece = (text or "").encode()
            else:
                piece = self.decode([token], skip_special_tokens=False).encode()
            known = self._pieces[token] = (piece, token in self._special_ids())
        piece, special = known
        return b"" if special and skip_special_tokens else piece

    def _special_ids(self) -> set[int]:
        """The special tokens' ids, read again when tokens were added since."""
        size = self.vocab_size
        if self._special[0] != size:
            decoder = self.backend.get_added_tokens_decoder()
            self._special = (size, {i for i, t in decoder.items() if t.special})
        return self._special[1]

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
