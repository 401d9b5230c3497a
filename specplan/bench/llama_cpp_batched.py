"""llama.cpp's own batched decoding, as its ``batched`` example runs it, for side-by-side benchmarks.

llama-cpp-python's ``Llama`` object serves one sequence at a time; a server of many streams calls
llama.cpp the way its ``batched`` example (and ``llama-server``'s slots) do: one context with
``n_seq_max`` sequences, every prompt prefilled in one ``llama_decode``, then one ``llama_decode``
per step carrying one token of every running sequence. This module is that loop over the low-level
bindings, greedy (argmax of each sequence's logits), so specplan's continuous batching can be
measured against llama.cpp's batched decode at the same B on the same GGUF.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np


class LlamaCppBatched:
    """B greedy streams in one llama.cpp context (``run`` returns the tokens generated)."""

    def __init__(self, path: str | Path, max_streams: int, max_tokens_per_stream: int, threads: int):
        import llama_cpp

        self.cpp = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        # One KV stream of max_tokens_per_stream cells per sequence (kv_unified off, its default).
        params.n_seq_max = max_streams
        params.n_ctx = max_streams * max_tokens_per_stream
        params.n_batch = params.n_ctx  # every prompt in one llama_decode call
        params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.max_streams = max_streams
        self.max_tokens = max_tokens_per_stream
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, max_streams)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1

    def _argmax(self, row: int) -> int:
        logits = self.cpp.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)).argmax())

    def run(self, prompts: list[list[int]], new_tokens: int) -> int:
        """Greedy ``new_tokens`` for every prompt, all streams at once; the tokens generated."""
        if len(prompts) > self.max_streams or max(map(len, prompts)) + new_tokens > self.max_tokens:
            raise ValueError("more streams or tokens than the context was made for")
        cpp = self.cpp
        cpp.llama_memory_clear(cpp.llama_get_memory(self.ctx), True)
        self.batch.n_tokens = 0
        rows = []  # per stream, the batch row whose logits give its next token
        for s, p in enumerate(prompts):
            for j, t in enumerate(p):
                self._add(t, j, s, j == len(p) - 1)
            rows.append(self.batch.n_tokens - 1)
        if cpp.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        positions = [len(p) for p in prompts]
        generated = 0
        for step in range(new_tokens):
            tokens = [self._argmax(r) for r in rows]
            generated += len(tokens)
            if step == new_tokens - 1:
                break
            self.batch.n_tokens = 0
            for s, t in enumerate(tokens):
                self._add(t, positions[s], s, True)
                positions[s] += 1
            rows = list(range(len(tokens)))
            if cpp.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
        return generated

    def close(self) -> None:
        cpp = self.cpp
        if self.batch is not None:
            cpp.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            cpp.llama_model_free(self.model)
            self.model = None
