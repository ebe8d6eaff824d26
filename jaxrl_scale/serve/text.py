"""A choice's text as its tokens arrive: detokenized incrementally, cut at stop strings.

A byte-level tokenizer's (Qwen, Llama-3) text is its ids' bytes read as UTF-8: each token's
bytes go through an incremental UTF-8 decoder, which holds a character's first bytes until its
last arrives. Other tokenizers' decoders may change how earlier tokens read (leading spaces):
for them a short window of ids is decoded twice per token (the window with and without the new
token) instead of the whole completion, as TGI and vLLM do, and a token that ends inside a
UTF-8 character (U+FFFD) waits for the character's last byte.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from jaxrl_scale.serve.backend import Delta

PARTIAL = "\ufffd"
HELD = 3  # tokens held back at most while they end inside a character (UTF-8: 4 bytes at most)


class ChoiceText:
    """One choice's kept tokens (ids, log-probs, top alternatives), its text, and how much of
    the text may be handed out: while the choice runs, a tail that could still become a stop
    string is held back. A stop string ends the choice: its text stops before it, and the token
    that completed it is the last one kept (the caller cancels the rest)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self._decode = tokenizer.decode
        # Byte-level: each token's bytes, read on by one UTF-8 decoder (invalid bytes come out
        # as U+FFFD, as the tokenizer's decode gives them).
        self._bytes = tokenizer.token_bytes if getattr(tokenizer, "byte_level", False) else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.stops = [s for s in stops if s]
        self._longest = max(map(len, self.stops), default=0)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.versions: list[int] = []  # each kept token's policy version (where known)
        self.offsets: list[int] = []  # where each token's text starts in `text`
        self.text = ""
        self.finish: str | None = None
        self.released = 0  # characters of `text` handed out
        self.sent = 0  # tokens handed out (`take_tokens`)
        self._prefix = self._read = 0  # the decoding window: ids[_prefix:]

    def add(self, delta: Delta) -> bool:
        """Take `delta`'s tokens; True when a stop string ended the choice here."""
        for k, token in enumerate(delta.token_ids):
            self.offsets.append(len(self.text))
            self.ids.append(token)
            self.logprobs.append(delta.logprobs[k])
            if delta.top is not None:
                self.top.append(delta.top[k])
            if delta.versions is not None:
                self.versions.append(delta.versions[k])
            before = len(self.text)
            final = delta.finish is not None and k == len(delta.token_ids) - 1
            if self._bytes is not None:
                self.text += self._utf8.decode(self._bytes(token), final)
            else:
                self.text += self._step(final=final)
            if self._cut(before):
                self.finish = "stop"
                return True
        if delta.finish is not None:
            if not delta.token_ids:  # nothing new to decode, but a held character ends here
                self.text += self._utf8.decode(b"", True) if self._bytes else self._step(final=True)
            self.finish = delta.finish
        return False

    def _step(self, *, final: bool) -> str:
        """The text the newest token adds (empty while it ends inside a character)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if final or (len(after) > len(before) and not after.endswith(PARTIAL)):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        if len(self.ids) - self._read > HELD:  # ids no character completes (a model's
            # garbage bytes): out as U+FFFD, all but the last HELD (a character's start may
            # be among them), so the window stays short and each token costs the same
            cut = len(self.ids) - HELD
            text = self._decode(self.ids[self._prefix : cut])
            self._prefix, self._read = self._read, cut
            return text[len(before) :]
        return ""

    def _cut(self, before: int) -> bool:
        """Cut `text` at the first stop string that ends in the characters from `before` on."""
        if not self.stops:
            return False
        start = max(0, before - self._longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _held(self) -> int:
        """Characters at the end of `text` that begin some stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def release(self) -> str:
        """The text not handed out yet that no stop string can take back."""
        end = len(self.text) if self.finish is not None else len(self.text) - self._held()
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out

    def take_tokens(self) -> slice:
        """The kept tokens not handed out yet (ids, logprobs, top and offsets index alike)."""
        span = slice(self.sent, len(self.ids))
        self.sent = len(self.ids)
        return span
