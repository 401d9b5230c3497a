"""Logprobs in OpenAI's response formats (chat ``content`` entries; completions' four parallel lists).

Token strings: each token's own bytes, decoded as UTF-8 (a token holding part of a character shows
U+FFFD; its ``bytes`` are exact). Byte-level BPE tokenizers (GPT-2, SmolLM2, Qwen2) map each byte
to a printable character, which we map back; any other tokenizer decodes the token alone.
"""

from __future__ import annotations

from functools import lru_cache

from ..sampling import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character byte-level BPE uses -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):  # the unprintable bytes map to 256, 257, ... in byte order
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenStrings:
    """token id -> (text, UTF-8 bytes), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self.byte_level = decoder is not None and "ByteLevel" in repr(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raw = str(token_id).encode()
        else:
            raw = None
            if self.byte_level:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                table = _byte_decoder()
                if isinstance(piece, str) and all(ch in table for ch in piece):
                    raw = bytes(table[ch] for ch in piece)
            if raw is None:
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)


def chat_content(entries: list[TokenLogprob], strings: TokenStrings) -> list[dict]:
    """Chat's ``logprobs.content``: per token {token, logprob, bytes, top_logprobs: [...]}."""
    def one(token_id: int, logprob: float) -> dict:
        text, raw = strings(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], strings: TokenStrings,
                        offset: int = 0) -> dict:
    """Completions' ``logprobs``: {tokens, token_logprobs, top_logprobs, text_offset}. ``offset``:
    where the first token's text starts in the choice's text. A None entry (the first prompt
    token) gets null token_logprobs and top_logprobs. Each top_logprobs dict also holds the chosen
    token, as OpenAI's and vLLM's do."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, e in zip(token_ids, entries):
        text = strings(token_id)[0]
        top = None
        if e is not None:
            top = {strings(t)[0]: lp for t, lp in e.top}
            top.setdefault(text, e.logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob if e is not None else None)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def joined(first: dict, second: dict) -> dict:
    """Two completions logprobs blocks, one after the other (echo: the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}
