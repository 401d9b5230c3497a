"""Incremental detokenization: the text of a growing token list, decoding a short window per step.

Decoding the whole output every step is quadratic in its length. Instead we keep the text decoded
so far and two offsets into the token list: ``prefix_offset`` (where the current window starts, a
few tokens back, so a token whose text depends on its left neighbour decodes right) and
``read_offset`` (tokens already turned into text). New text is the window's text minus the text
of its already-read part. A window that ends inside a multi-byte UTF-8 character decodes to
U+FFFD; we wait for the next token instead of emitting it.

Worked example (byte-level BPE, tokens t0..t3, where t2 t3 together spell "é"):
  ids [t0]          window [t0]       -> text "Hi",       prefix 0, read 1
  ids [t0 t1]       window [t0 t1]    -> "Hi there" - "Hi" = " there";  prefix 1, read 2
  ids [.. t2]       window [t1 t2]    -> " there\ufffd": incomplete, wait (offsets stay)
  ids [.. t2 t3]    window [t1 t2 t3] -> " there é" - " there" = " é"; prefix 2, read 4

The engine uses it to find stop strings; the server to stream text deltas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IncrementalDetokenizer:
    text: str = ""  # everything decoded so far
    prefix_offset: int = 0
    read_offset: int = 0

    def update(self, tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode what ``token_ids`` gained since the last call; returns the new text ("" if none yet)."""
        if len(token_ids) <= self.read_offset:
            return ""
        done = tokenizer.decode(token_ids[self.prefix_offset:self.read_offset],
                                skip_special_tokens=skip_special_tokens) if self.read_offset > self.prefix_offset else ""
        window = tokenizer.decode(token_ids[self.prefix_offset:], skip_special_tokens=skip_special_tokens)
        if len(window) <= len(done) or window.endswith("\ufffd"):
            return ""
        new = window[len(done):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return new
