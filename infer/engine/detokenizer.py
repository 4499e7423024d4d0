"""Incremental detokenization: the text of a growing token list, decoding only the new tokens.

vLLM's prefix / read offsets: `decode(ids[prefix:read])` is the text already emitted for a short
window before the new tokens, `decode(ids[prefix:])` the same window plus the new tokens; the new
text is the difference. Decoding a window instead of one token handles tokens that merge with
their neighbours (byte-level BPE pieces of one multi-byte character, leading-space rules), and a
window that ends inside a character (a trailing U+FFFD) waits for the next token. Each step decodes
a few tokens, so a whole output costs time linear in its length (decoding everything again at each
token, as before, was quadratic). `finish` flushes what is held back, so the final text equals
`decode(ids)`.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.prefix = self.read = 0  # ids[prefix:read] decoded to the tail of `text` already
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (the same list, grown since the last call), complete characters only."""
        done = self._decode(ids[self.prefix:self.read])
        new = self._decode(ids[self.prefix:])
        if len(new) > len(done) and not new.endswith("\ufffd"):
            self.text += new[len(done):]
            self.prefix, self.read = self.read, len(ids)
        return self.text

    def finish(self, ids: list[int]) -> str:
        """The text of all of `ids`, including an incomplete character held back so far."""
        done = self._decode(ids[self.prefix:self.read])
        new = self._decode(ids[self.prefix:])
        if len(new) > len(done):
            self.text += new[len(done):]
        self.prefix = self.read = len(ids)
        return self.text
