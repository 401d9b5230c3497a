"""A clairvoyant decider for offline evaluation: how much per-request k could gain at all.

The oracle (policies/oracle.py) answers "how good is the best fixed k per cell"; this answers
"how good is the best k per request and step", the ceiling any adaptive policy works under with a
given proposer on a given machine. It cheats: before each step it already knows, for each request,
how many of the proposer's drafts the target will accept, and asks for exactly that many. So no
draft is ever rejected and every draft that would have been accepted is verified.

That is the best k of the step whenever an extra query row costs less than the token it brings,
which holds on both sides of the roofline: a memory-bound step barely notices a row, and a
compute-bound one costs about the same per row as the rows already in it. (A kernel that jumps in
cost at a tile size could make skipping one sure draft better; that is the approximation.)

How it knows: greedy speculation is lossless, so every decider of a cell emits the same tokens,
and a reference run (SD off) gives each request's output. A lookup proposer whose drafts depend
only on the request's own tokens (n-gram) proposes the same drafts at the same output length in
any run; so replaying the reference through such a proposer gives, per request and output length
p, the number of drafts that match the reference from p on: the accepted length.
Worked example: prompt [1, 5, 7, 9], reference output [5, 7, 2]. At p = 1 the tokens end with 5,
as does [1, 5] in the prompt, so the n-gram proposer drafts what came after that 5: [7, 9, 5]. The
reference continues [7, 2]: 1 draft is accepted, and the decider asks for k = 1 there. At p = 2 the
tokens end with "5 7", whose earlier occurrence was followed by [9, 5, 7]; the reference continues
[2]: k = 0.

Proposers whose drafts cannot be replayed offline (a draft head's depend on the target's hidden
states, the chain's on both, suffix decoding's on what other requests emitted before) get the same
table from a run instead (``AcceptanceRecorder``): every request asks for max_k drafts each step,
and what the target accepted is noted per request and output length. The clairvoyant run then
visits exactly the positions that run did: a request at output length p that accepts a of its
drafts moves to p + a + 1 in both (asking for exactly a, all of them accepted, plus the bonus
token), so every step meets the same requests at the same lengths, and the proposer sees the same
tokens (a head's j-th draft is chained on the drafts before it, never on how many follow).
Worked example: max_k = 4, a request at p = 10 accepts 2 of 4 drafts, then at p = 13 accepts 0:
the table reads [10] = 2, [13] = 0; the clairvoyant run asks for 2 at p = 10 (both accepted, the
bonus makes 3 tokens: p = 13) and for 0 at p = 13. A position the run never visited reads 0.
For a draft model, asking for exactly the accepted drafts is not always the step's best choice:
its passes run one per position up to the deepest request's k, paid by the whole batch, so above
B = 1 one request's long accepted run can cost the step more than it brings. There the decider is
a reference (every draft it verifies is accepted), not a ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

from specplan.engine import Proposer, SamplingParams, Sequence, StepRecord, StepView

# Proposers whose drafts are a function of the request's own tokens. Suffix decoding also learns
# from other requests' outputs, which depend on the order requests ran in; a draft model is exact
# only in its own run.
SELF_CONTAINED_PROPOSERS = ("ngram",)


@dataclass(frozen=True)
class Replayed:
    """One request at one output length, replayed through the proposer against the reference."""

    match_length: int  # what the proposer reported (0: no match)
    num_drafts: int  # drafts it proposed, cut where the reference output ends (those can be judged)
    accepted: int  # of those, how many equal the reference from here on


def replay(proposer: Proposer, prompts: Seq[Seq[int]], outputs: Seq[Seq[int]], max_k: int) -> list[list[Replayed]]:
    """Per request, per output length p (0 .. len(output) - 1): the proposer's drafts (up to
    ``max_k``) against the reference output from p on."""
    if getattr(proposer, "name", None) not in SELF_CONTAINED_PROPOSERS:
        raise ValueError(f"replaying needs a proposer whose drafts depend only on the request's own tokens "
                         f"({', '.join(SELF_CONTAINED_PROPOSERS)}), not {getattr(proposer, 'name', proposer)!r}")
    table = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        seq = Sequence(seq_id=-1 - i, request_id=f"replay-{i}", prompt_token_ids=list(prompt),
                       params=SamplingParams(temperature=0.0))
        steps = []
        for p in range(len(output)):
            proposal = proposer.propose([seq], [max_k])
            drafts = proposal.token_ids[0]
            future = output[p:p + len(drafts)]
            n = 0
            while n < len(future) and drafts[n] == future[n]:
                n += 1
            steps.append(Replayed((proposal.match_length or [0])[0], len(future), n))
            seq.token_ids.append(output[p])
        proposer.on_finished(seq)
        table.append(steps)
    return table


def accepted_lengths(proposer: Proposer, prompts: Seq[Seq[int]], outputs: Seq[Seq[int]],
                     max_k: int) -> list[list[int]]:
    """Per request, per output length p: how many of the proposer's drafts (up to ``max_k``)
    equal the reference output from p on."""
    return [[r.accepted for r in steps] for steps in replay(proposer, prompts, outputs, max_k)]


@dataclass(frozen=True)
class ClairvoyantDecider:
    """k = the drafts that will be accepted (capped by the engine's max_k); see the module doc.
    ``accepted[i][p]``: from ``accepted_lengths``; ``index_of`` maps a request id to its i."""

    accepted: Seq[Seq[int]]
    index_of: Callable[[str], int]

    def decide(self, view: StepView) -> list[int]:
        ks = []
        for rv in view.requests:
            row = self.accepted[self.index_of(rv.request_id)]
            p = rv.num_output_tokens
            ks.append(min(row[p], rv.max_k) if p < len(row) else 0)
        return ks

    def observe(self, record: StepRecord) -> None:
        pass


@dataclass
class AcceptanceRecorder:
    """A decider that asks every request for ``k`` drafts each step and records, per request and
    output length, how many the target accepted (``accepted[i][p]``; 0 where the run did not step
    from p): the clairvoyant table for any proposer (module doc). ``index_of`` maps a request id to
    its i; ``max_tokens`` sizes the rows."""

    k: int
    index_of: Callable[[str], int]
    num_requests: int
    max_tokens: int
    accepted: list[list[int]] = field(init=False)
    _at: dict[int, tuple[int, int]] = field(init=False, default_factory=dict)  # seq_id -> (i, p) this step

    def __post_init__(self) -> None:
        self.accepted = [[0] * self.max_tokens for _ in range(self.num_requests)]

    def decide(self, view: StepView) -> list[int]:
        self._at = {rv.seq_id: (self.index_of(rv.request_id), rv.num_output_tokens) for rv in view.requests}
        return [self.k] * len(view.requests)

    def observe(self, record: StepRecord) -> None:
        for rr in record.requests:
            at = self._at.get(rr.seq_id)
            if at is not None and at[1] < self.max_tokens:
                self.accepted[at[0]][at[1]] = rr.num_accepted
