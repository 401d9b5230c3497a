"""Building the adaptive planner for `generate --adaptive` and `serve --adaptive`: find (or make)
the profile for this model and machine, check it matches, and steer with it."""

from __future__ import annotations

import torch
import typer

from specplan.engine import LoadedModel
from specplan.profiler.profile import PROFILE_VERSION, Profile, ProfileError, check_matches, fingerprint
from specplan.profiler.run import default_profile_path, profile_cache_dir, run_profile


def load_or_make_profile(loaded: LoadedModel, profile_path: str | None, dtype: torch.dtype = torch.float32,
                         device: str = "cpu") -> Profile:
    """The given profile (must match), else the cached one for this fingerprint, else a fresh quick one.

    Raises ProfileError (one line) for a missing, corrupted or mismatched --profile file.
    """
    current = fingerprint(loaded.config, dtype, device)
    if profile_path is not None:
        profile = Profile.load(profile_path)
        for warning in check_matches(profile, current, profile_path):
            typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
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
            return profile
        except ProfileError as e:
            typer.secho(f"warning: {e}; making a fresh one", err=True, fg=typer.colors.YELLOW)
    typer.secho("[no profile for this model and machine yet: measuring a quick one (a few minutes; it is cached for later runs)]", err=True,
                fg=typer.colors.BRIGHT_BLACK)
    # The report goes beside the cached profile: serving must not rewrite the repository's reports/.
    profile, path, report = run_profile(loaded=loaded, quick=True, report_dir=profile_cache_dir())
    typer.secho(f"[profile written to {path}; report {report}]", err=True, fg=typer.colors.BRIGHT_BLACK)
    return profile


def make_planner(loaded: LoadedModel, *, proposer: str, policy: str | None, profile_path: str | None,
                 sla_itl_ms: float | None, max_k: int):
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    rule = make_policy(policy or "goodput")  # ValueError for a bad name before a profile is measured
    profile = load_or_make_profile(loaded, profile_path)
    return planner_from_profile(profile, rule, proposer=proposer, max_k=max_k,
                                sla_itl_s=sla_itl_ms / 1000 if sla_itl_ms is not None else None)


__all__ = ["load_or_make_profile", "make_planner"]
