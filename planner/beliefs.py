"""Beliefs that outlive the process: what the planner learned, saved beside its profile.

A planner starts from its built-in priors and learns, step by step, how often drafts are accepted
and what steps really cost. Without a store all of that is lost when the process exits, and every
new process (every `specplan generate`, every restart of `serve`) decides its first requests on the
priors alone. The store keeps:

* **acceptance** – every pooled belief (planner/acceptance.py ``PooledAcceptance``), keyed by
  ``BeliefKey``: proposer, workload tag, greedy or sampled, and a *signal* with its bucket, the
  quantity the belief is conditioned on: ``match`` (the lookup's match-length bucket,
  ``match_bucket``) or ``none``. (A draft head's per-token confidence is kept apart, below: it is
  read while drafting, one token at a time, not before the decision.)
* **calibration** – the accepted / expected ratio over chosen drafts (planner/calibration.py), per
  proposer.
* **confidence** – a draft head's confidence -> acceptance table (planner/confidence.py), per
  proposer: what the confidence stop reads.
* **step cost** – the drift factor, the draft slope's per-batch-size fits (planner/drift.py) and
  the overhead / drafting-cost fit per proposer (planner/timing.py). They are corrections *to one
  latency model*, so they carry that model's id (``latency_id``) and are only restored under it:
  after a new profile the acceptance beliefs still load, the step-cost ones start afresh.

Loaded beliefs are capped in weight (``BeliefConfig``): a pool weighs at most ``max_pool_evidence``
request-steps, a fit at most ``max_fit_steps`` steps, and so on. The saved state is whole; the cap
applies when loading, so a belief learned on yesterday's traffic starts today's run warm but gives
way to today's within a few dozen steps.

The file: JSON, ``{"format": "specplan-beliefs", "version": 1, ...}``, written through a temporary
file and ``os.replace`` (a crash never leaves half a file). Saving merges with what is on disk, so
the beliefs of other proposers and workloads survive. A file that cannot be read, is not JSON, is
another program's or another model's, or holds malformed entries is named in one warning and
ignored: the planner then starts from its priors, as it would without a file.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .acceptance import PooledAcceptance, default_prior
from .calibration import AcceptanceCalibration
from .confidence import ConfidenceCalibration
from .drift import DraftSlope, DriftCorrection
from .timing import StepTimingLearner

if TYPE_CHECKING:
    from .controller import Planner

BELIEFS_FORMAT = "specplan-beliefs"
BELIEFS_VERSION = 1

# What a belief is conditioned on, besides proposer, workload and greedy.
SIGNAL_NONE = "none"  # nothing: the request's one belief for its proposer (bucket 0)
SIGNAL_MATCH = "match"  # the lookup's match-length bucket (planner/acceptance.py match_bucket)
# The planner restores only the signals it conditions on and keeps others in the file untouched.


class BeliefFileError(ValueError):
    """A beliefs file that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class BeliefKey:
    proposer: str
    workload: str
    greedy: bool
    signal: str  # SIGNAL_MATCH, SIGNAL_NONE, ...
    bucket: int

    @staticmethod
    def of_pool(key: tuple[str, str, bool, int | None]) -> "BeliefKey":
        """The key of a planner pool (proposer, workload, greedy, match bucket or None)."""
        proposer, workload, greedy, match = key
        return BeliefKey(proposer, workload, greedy, SIGNAL_NONE if match is None else SIGNAL_MATCH, match or 0)

    def pool_key(self) -> tuple[str, str, bool, int | None] | None:
        """The planner's pool key, or None for a signal the planner does not condition on."""
        if self.signal == SIGNAL_NONE:
            return self.proposer, self.workload, self.greedy, None
        if self.signal == SIGNAL_MATCH and self.bucket >= 1:
            return self.proposer, self.workload, self.greedy, self.bucket
        return None

    @property
    def name(self) -> str:
        """e.g. "ngram/default/greedy/match:4": the key in the file."""
        return f"{self.proposer}/{self.workload}/{'greedy' if self.greedy else 'sampled'}/{self.signal}:{self.bucket}"

    @staticmethod
    def parse(name: str) -> "BeliefKey":
        proposer, workload, mode, signal = name.rsplit("/", 3) if name.count("/") >= 3 else ("", "", "", "")
        kind, _, bucket = signal.partition(":")
        if not proposer or mode not in ("greedy", "sampled") or not kind or not bucket.isdigit():
            raise ValueError(f"malformed belief key {name!r}")
        return BeliefKey(proposer, workload, mode == "greedy", kind, int(bucket))


@dataclass(frozen=True)
class BeliefConfig:
    """How much loaded beliefs weigh at most (see the module doc)."""

    # Request-steps behind a loaded pool. Under the goodput policy's slow-start threshold (32), so
    # a pool restored from another run does not hold requests back, and small against the pool's
    # memory (~500 request-steps): 24 request-steps of this run's traffic weigh as much as it.
    max_pool_evidence: float = 24.0
    max_calibration_tokens: float = 16.0  # expected tokens behind a loaded calibration ratio
    # Judged drafts behind a loaded confidence table, in all: enough to move each bucket off its
    # prior, little against what this run's first hundred steps judge.
    max_confidence_drafts: float = 200.0
    max_fit_steps: float = 8.0  # steps behind a loaded draft-slope bucket or timing fit
    max_drift_samples: int = 4  # samples behind a loaded drift factor

    def __post_init__(self) -> None:
        for name in ("max_pool_evidence", "max_calibration_tokens", "max_fit_steps", "max_confidence_drafts"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_drift_samples < 0:
            raise ValueError("max_drift_samples must be >= 0")


def latency_id(latency_model: Mapping[str, Any]) -> str:
    """The id step-cost corrections are tied to: a hash of the latency model's parameters (a
    profile's ``latency_model`` dict)."""
    return hashlib.sha256(json.dumps(latency_model, sort_keys=True, default=str).encode()).hexdigest()[:16]


def capture(planner: Planner, *, latency: str | None = None, identity: Mapping[str, str] | None = None) -> dict:
    """The planner's beliefs as a document (``latency``: the id of its latency model)."""
    proposer = planner.proposer
    doc: dict[str, Any] = {
        "format": BELIEFS_FORMAT, "version": BELIEFS_VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "identity": dict(identity or {}),
        "acceptance": {BeliefKey.of_pool(key).name: pool.state()
                       for key, pool in planner.pools.items() if pool.evidence > 0},
        "calibration": {}, "confidence": {}, "timing": {}, "step_cost": None,
    }
    if proposer is not None and planner.calibration is not None and planner.calibration.expected > 0:
        doc["calibration"][proposer] = planner.calibration.state()
    if proposer is not None and planner.confidence is not None and planner.confidence.evidence > 0:
        doc["confidence"][proposer] = planner.confidence.state()
    if proposer is not None and planner.timing is not None and planner.timing.steps > 0:
        doc["timing"][proposer] = planner.timing.state()
    if planner.latency is not None and latency is not None and planner.drift.samples > 0:
        doc["step_cost"] = {"latency_id": latency, "drift": planner.drift.state(),
                            "draft_slope": planner.draft_slope.state()}
    return doc


def merge(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict:
    """``new`` over ``old``: per belief key, per proposer; step cost whole (one latency model)."""
    if not old or dict(old.get("identity") or {}) != dict(new.get("identity") or {}):
        return dict(new)
    merged = dict(new)
    for section in ("acceptance", "calibration", "confidence", "timing"):
        merged[section] = {**(old.get(section) or {}), **(new.get(section) or {})}
    if new.get("step_cost") is None:
        merged["step_cost"] = old.get("step_cost")
    return merged


@dataclass(frozen=True)
class Restored:
    """What a restore took over."""

    pools: int = 0
    calibration: bool = False
    timing: bool = False
    step_cost: bool = False
    confidence: bool = False

    def describe(self) -> str:
        parts = [f"{self.pools} acceptance belief{'s' if self.pools != 1 else ''}"]
        parts += [name for name, on in (("calibration", self.calibration), ("draft confidence", self.confidence),
                                        ("drafting cost", self.timing),
                                        ("step-cost corrections", self.step_cost)) if on]
        return ", ".join(parts)


class _Scratch:
    """Fresh learners with a planner's configuration: a restore is tried on these first, so a
    malformed document leaves the planner untouched."""

    def __init__(self, planner: Planner):
        cfg = planner.config
        self.proposer = planner.proposer
        self.latency = planner.latency
        self._acceptance = planner.acceptance_config
        self.calibration = AcceptanceCalibration(cfg.calibration) if cfg.calibration is not None else None
        self.confidence = ConfidenceCalibration(cfg.confidence) if cfg.confidence is not None else None
        self.drift = DriftCorrection(cfg.drift)
        self.draft_slope = DraftSlope(cfg.draft_slope)
        self.timing = StepTimingLearner(planner.draft_cost_prior, cfg.timing) if planner.timing is not None else None

    def pool(self, proposer: str, workload: str, greedy: bool = True, match: int | None = None) -> PooledAcceptance:
        return PooledAcceptance(default_prior(proposer), self._acceptance)


def _apply(target, doc: Mapping[str, Any], latency: str | None, config: BeliefConfig) -> Restored:
    pools = 0
    for name, state in (doc.get("acceptance") or {}).items():
        key = BeliefKey.parse(name).pool_key()
        if key is not None:
            target.pool(*key).load_state(state, config.max_pool_evidence)
            pools += 1
    proposer = target.proposer
    calibration = (doc.get("calibration") or {}).get(proposer)
    if calibration is not None and target.calibration is not None:
        target.calibration.load_state(calibration, config.max_calibration_tokens)
    confidence = (doc.get("confidence") or {}).get(proposer)
    if confidence is not None and target.confidence is not None:
        target.confidence.load_state(confidence, config.max_confidence_drafts)
    timing = (doc.get("timing") or {}).get(proposer)
    if timing is not None and target.timing is not None:
        target.timing.load_state(timing, config.max_fit_steps)
    step_cost = doc.get("step_cost")
    restore_cost = (step_cost is not None and latency is not None and target.latency is not None
                    and step_cost.get("latency_id") == latency)
    if restore_cost:
        target.drift.load_state(step_cost["drift"], config.max_drift_samples)
        target.draft_slope.load_state(step_cost["draft_slope"], config.max_fit_steps)
    return Restored(pools, calibration is not None and target.calibration is not None,
                    timing is not None and target.timing is not None, restore_cost,
                    confidence is not None and target.confidence is not None)


def restore(planner: Planner, doc: Mapping[str, Any], *, latency: str | None = None,
            config: BeliefConfig = BeliefConfig()) -> Restored:
    """Load a beliefs document into a planner (weights capped by ``config``). Raises ValueError
    for a malformed document, before touching the planner."""
    try:
        _apply(_Scratch(planner), doc, latency, config)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"malformed entry ({type(e).__name__}: {e})") from None
    return _apply(planner, doc, latency, config)


def read_beliefs(path: Path, identity: Mapping[str, str] | None = None) -> dict | None:
    """The document in ``path`` (None if there is none); BeliefFileError, one line, if unusable."""
    fix = "delete it or run `specplan profile --reset-beliefs`"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BeliefFileError(f"beliefs file {path} cannot be read ({type(e).__name__}); {fix}") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BeliefFileError(f"beliefs file {path} is corrupted or truncated ({e}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != BELIEFS_FORMAT:
        raise BeliefFileError(f"beliefs file {path} is not a specplan beliefs file; {fix}")
    if not isinstance(doc.get("version"), int) or doc["version"] > BELIEFS_VERSION:
        raise BeliefFileError(f"beliefs file {path} has version {doc.get('version')!r}, this specplan reads "
                              f"up to {BELIEFS_VERSION}; {fix}")
    if identity and dict(doc.get("identity") or {}) != dict(identity):
        raise BeliefFileError(f"beliefs file {path} was learned for another model "
                              f"({(doc.get('identity') or {}).get('model', '?')}); {fix}")
    return doc


def write_beliefs(path: Path, doc: Mapping[str, Any]) -> None:
    """Atomically: a temporary file beside it (named by the process), then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class BeliefStore:
    """One beliefs file: loaded once (a bad file warns once and is ignored), saved by merging.

    path: the file (specplan/adaptive.py puts it beside the cached profile, same keying).
    latency: the id of the latency model the planners steer by (``latency_id``).
    identity: what the beliefs are about (model name and config hash); a file for another is foreign.
    warn: how the one warning line is shown (the CLI colours it).
    """

    def __init__(self, path: Path | str, *, latency: str | None = None, identity: Mapping[str, str] | None = None,
                 config: BeliefConfig = BeliefConfig(), warn: Callable[[str], None] = _warn):
        self.path = Path(path)
        self.latency = latency
        self.identity = dict(identity or {})
        self.config = config
        self.warn = warn
        self._loaded = False
        self._doc: dict | None = None
        self.saves = 0

    def document(self) -> dict | None:
        """The file's document, read once; None if there is none or it is unusable (warned once)."""
        if not self._loaded:
            self._loaded = True
            try:
                self._doc = read_beliefs(self.path, self.identity)
            except BeliefFileError as e:
                self.warn(f"{e}; starting from the built-in priors")
        return self._doc

    def load_into(self, planner: Planner) -> Restored:
        """Restore the file's beliefs into ``planner`` (nothing, if there are none or they are unusable)."""
        doc = self.document()
        if doc is None:
            return Restored()
        try:
            return restore(planner, doc, latency=self.latency, config=self.config)
        except ValueError as e:
            self.warn(f"beliefs file {self.path} holds a {e}; starting from the built-in priors")
            self._doc = None  # warned once: later planners start cold too, silently
            return Restored()

    def save(self, planner: Planner) -> None:
        """Write the planner's beliefs, merged over what the file holds (an unusable file is replaced)."""
        try:
            on_disk = read_beliefs(self.path, self.identity)
        except BeliefFileError:
            on_disk = None
        write_beliefs(self.path, merge(on_disk, capture(planner, latency=self.latency, identity=self.identity)))
        self.saves += 1

    def reset(self) -> bool:
        """Delete the file; whether there was one."""
        try:
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False


__all__ = ["BELIEFS_FORMAT", "BELIEFS_VERSION", "BeliefConfig", "BeliefFileError", "BeliefKey", "BeliefStore",
           "Restored", "capture", "latency_id", "merge", "read_beliefs", "restore", "write_beliefs"]
