"""Building the adaptive planner for `generate --adaptive` and `serve --adaptive`: find (or make)
the profile for this model and machine, check it matches, and steer with it; start from the beliefs
earlier runs saved beside it (planner/beliefs.py), and save them again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

import torch
import typer

from specplan.engine import LoadedModel
from specplan.profiler.profile import PROFILE_VERSION, Profile, ProfileError, check_matches, fingerprint
from specplan.profiler.run import default_beliefs_path, default_profile_path, profile_cache_dir, run_profile


def load_or_make_profile(loaded: LoadedModel, profile_path: str | None, dtype: torch.dtype = torch.float32,
                         device: str = "cpu", proposers: Iterable[str] = (), kv_dtype: torch.dtype | None = None
                         ) -> Profile:
    """The given profile (must match), else the cached one for this fingerprint, else a fresh quick one.
    ``proposers``: the ones about to run; a draft head's pass cost missing from the profile (one
    measured before the profiler timed heads) is measured now and, in the cached profile, kept.
    ``kv_dtype``: the KV cache the engine runs with (None: its auto choice).

    Raises ProfileError (one line) for a missing, corrupted or mismatched --profile file.
    """
    current = fingerprint(loaded.config, dtype, device, kv_dtype)
    if profile_path is not None:
        profile = Profile.load(profile_path)
        for warning in check_matches(profile, current, profile_path):
            typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
        _add_head_cost(profile, loaded, proposers, save_to=None)
        return profile
    cached = default_profile_path(current)
    if cached.exists():
        try:
            profile = Profile.load(cached)
            check_matches(profile, current, cached)
            if profile.version < PROFILE_VERSION:
                raise ProfileError(f"profile {cached} was measured by an older profiler "
                                   f"(method {profile.version}, now {PROFILE_VERSION})")
            typer.secho(f"[using profile {cached}]", err=True, fg=typer.colors.BRIGHT_BLACK)
            _add_head_cost(profile, loaded, proposers, save_to=cached)
            return profile
        except ProfileError as e:
            typer.secho(f"warning: {e}; making a fresh one", err=True, fg=typer.colors.YELLOW)
    typer.secho("[no profile for this model and machine yet: measuring a quick one (a few minutes; it is cached for later runs)]", err=True,
                fg=typer.colors.BRIGHT_BLACK)
    # The report goes beside the cached profile: serving must not rewrite the repository's reports/.
    profile, path, report = run_profile(loaded=loaded, quick=True, report_dir=profile_cache_dir(), kv_dtype=kv_dtype)
    typer.secho(f"[profile written to {path}; report {report}]", err=True, fg=typer.colors.BRIGHT_BLACK)
    busy = profile.fit.busy_machine_warning()
    if busy:
        typer.secho(f"warning: {busy}", err=True, fg=typer.colors.YELLOW)
    return profile


def _add_head_cost(profile: Profile, loaded: LoadedModel, proposers: Iterable[str], save_to: Path | None) -> None:
    """Time the shipped head's pass into ``profile`` if a head proposer is about to run without it."""
    from specplan.engine.proposers.factory import HEAD_PROPOSERS
    from specplan.profiler.run import measure_head_cost

    if not any(p in HEAD_PROPOSERS and p not in profile.draft_costs for p in proposers):
        return
    typer.secho("[the profile has no draft-head pass cost yet: timing the head (under a minute)]", err=True,
                fg=typer.colors.BRIGHT_BLACK)
    cost = measure_head_cost(loaded)
    if cost is None:  # no head ships for this model: a --draft-head one is learned online
        return
    profile.draft_costs.update(dict.fromkeys(HEAD_PROPOSERS, cost))
    if save_to is not None:
        profile.save(save_to)


def _warn(message: str) -> None:
    typer.secho(f"warning: {message}", err=True, fg=typer.colors.YELLOW)


def belief_store(loaded: LoadedModel, profile: Profile | None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", path=None, kv_dtype: torch.dtype | None = None):
    """The beliefs file for this model and machine (``path``, default: beside the cached profile,
    same key), tied to ``profile``'s latency model; a bad file is named in one warning when first read."""
    from specplan.planner.beliefs import BeliefStore, latency_id

    current = fingerprint(loaded.config, dtype, device, kv_dtype)
    return BeliefStore(path or default_beliefs_path(current), identity={"model": current.model,
                                                                "model_config_hash": current.model_config_hash},
                       latency=latency_id(profile.latency_model) if profile is not None else None, warn=_warn)


def make_planner(loaded: LoadedModel, *, proposer: str, policy: str | None, profile_path: str | None,
                 sla_itl_ms: float | None, max_k: int, beliefs: bool = True, kv_dtype: torch.dtype | None = None):
    """(the planner, its belief store or None): with ``beliefs``, the planner starts from what
    earlier runs saved for this model and machine; the caller saves it back (``store.save``).
    ``kv_dtype``: the engine's KV cache (None: its auto choice), part of the profile's key."""
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    rule = make_policy(policy or "goodput")  # ValueError for a bad name before a profile is measured
    profile = load_or_make_profile(loaded, profile_path, proposers=(proposer,), kv_dtype=kv_dtype)
    planner = planner_from_profile(profile, rule, proposer=proposer, max_k=max_k,
                                   sla_itl_s=sla_itl_ms / 1000 if sla_itl_ms is not None else None)
    store = belief_store(loaded, profile, kv_dtype=kv_dtype) if beliefs else None
    if store is not None:
        restored = store.load_into(planner)
        if restored.pools or restored.step_cost:
            typer.secho(f"[beliefs from {store.path}: {restored.describe()}]", err=True, fg=typer.colors.BRIGHT_BLACK)
    return planner, store


class SavesBeliefs:
    """A SpecDecider around a planner that saves its beliefs every ``interval_s`` seconds, after a
    step, in the engine's own thread (so the planner is never read while it learns). ``serve``
    steers with it and saves once more at shutdown (``save``)."""

    def __init__(self, planner: Any, store: Any, interval_s: float = 60.0):
        self.planner = planner
        self.store = store
        self.interval_s = interval_s
        self._last = time.monotonic()

    def decide(self, view: Any) -> list[int]:
        return self.planner.decide(view)

    def observe(self, record: Any) -> None:
        self.planner.observe(record)
        if time.monotonic() - self._last >= self.interval_s:
            self.save()

    def save(self) -> None:
        self._last = time.monotonic()
        try:
            self.store.save(self.planner)
        except OSError as e:  # a full or read-only disk must not stop serving
            _warn(f"could not save beliefs to {self.store.path} ({e})")

    def __getattr__(self, name: str) -> Any:  # predicted_step_s and whatever else the server reads
        if name == "planner":
            raise AttributeError(name)
        return getattr(self.planner, name)


__all__ = ["SavesBeliefs", "belief_store", "load_or_make_profile", "make_planner"]
