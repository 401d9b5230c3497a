"""Incremental detokenization (engine/detokenizer.py) against decoding everything at once, and
stop strings found incrementally by the engine."""

from __future__ import annotations


import pytest

from specplan.engine.detokenizer import IncrementalDetokenizer
from specplan.engine.engine import _find_stop

from conftest import chat_tokenizer


class ByteTokenizer:
    """Each token is one UTF-8 byte (ids 0..255): multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_equals_the_full_decode_with_split_characters():
    tok = ByteTokenizer()
    text = "naïve café — 東京 ok 🚀!"
    ids = list(text.encode())
    detok = IncrementalDetokenizer()
    pieces = []
    for n in range(1, len(ids) + 1):
        piece = detok.update(tok, ids[:n])
        assert "\ufffd" not in piece  # never emits half a character
        pieces.append(piece)
    assert "".join(pieces) == detok.text == text
    assert detok.update(tok, ids) == ""  # nothing new


def test_incremental_matches_full_decode_on_a_byte_level_bpe():
    text = "def f(x):\n    return x ** 2  # naïve — 東京 🚀\n"
    tok = chat_tokenizer([text * 4, "the quick brown fox jumps over the lazy dog"], vocab_size=320)
    ids = tok.encode(text * 3 + "<|im_end|> tail", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer()
        for n in range(1, len(ids) + 1):
            detok.update(tok, ids[:n], skip_special_tokens=skip)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seen", [0, 3, 7, 9, 12])
def test_find_stop_only_looks_where_a_new_match_can_end(seen):
    text = "abc STOP def END"
    # A match ending after `seen` is found whatever was searched before; the earliest wins.
    want = (4, "STOP") if seen < 8 else (13, "END")
    assert _find_stop(text, ("END", "STOP"), seen) == want
    assert _find_stop(text, ("nope",), seen) is None
