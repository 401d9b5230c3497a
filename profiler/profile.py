"""The Profile: what `specplan profile` measured, as JSON the planner loads.

It carries a fingerprint of what was measured (model, dtype, device, threads, torch version,
the engine's kernels),
the machine's ceilings, the model's cost constants, the fitted latency model with its error on
held-out cells and the pure roofline's error, and the measured drafting cost per proposer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError, field_validator

from .fit import HingeLatencyModel
from .latency_model import DraftCost, StepShape
from .machine import cpu_name
from .roofline import LinearRoofline


class ProfileError(ValueError):
    """A profile file that cannot be used; the message is one line with the fix."""


class Fingerprint(BaseModel):
    model: str
    model_config_hash: str
    dtype: str
    device: str
    threads: int
    torch_version: str
    cpu: str
    kernels: str = "unknown"  # engine.cpu_kernels.build_id() on CPU; profiles from before it: "unknown"
    # The KV cache's element type (engine/model_runner.py kv_cache_dtype); profiles from before the
    # float16 cache: "unknown" (they were timed over float32).
    kv_cache: str = "unknown"

    def mismatches(self, other: "Fingerprint") -> list[str]:
        """Fields that differ in a way that makes timings invalid (torch version/CPU/kernels: warn only)."""
        return [f for f in ("model", "model_config_hash", "dtype", "device", "threads")
                if getattr(self, f) != getattr(other, f)]


class CeilingsModel(BaseModel):
    peak_flops: float
    bandwidth: float
    ridge: float


class CostConstants(BaseModel):
    weight_bytes: float  # read once per step
    flops_per_token: float  # matmul FLOPs per query token (all layers, no attention, no LM head)
    lm_head_flops_per_row: float
    kv_bytes_per_token: float  # K+V, all layers, per cached token
    attention_flops_per_token_pair: float  # per (query token, key) pair, all layers


# A quick profile measured on a quiet 2-core VM predicts held-out cells within 2.6-8.6%; one
# measured beside another job read 27.7% (reports/README.md). The planner still corrects step
# times online, but a user should know such a profile is worth measuring again.
NOISY_FIT_PERCENT = 10.0


class FitError(BaseModel):
    heldout_mape: float  # % on cells held out of the fit
    train_mape: float
    roofline_mape: float  # % of the pure roofline prediction on all cells
    num_cells: int
    num_heldout: int

    def busy_machine_warning(self) -> str | None:
        """One line for a fit too far off to trust (likely a busy machine), None otherwise."""
        if self.heldout_mape <= NOISY_FIT_PERCENT:
            return None
        return (f"the profile's latency model is off by {self.heldout_mape:.1f}% on held-out cells (a quiet "
                f"machine reads under {NOISY_FIT_PERCENT:g}%): the machine was likely busy while it was measured. "
                "The planner corrects step times as it serves; to measure again on a quiet machine, run "
                "`specplan profile` with the options this one was made with (--model, --quantize, --engine; "
                "it replaces the cached profile)")


# Profiles written before the profiler stored the planner's ``DraftCost`` named its fields so.
_OLD_DRAFT_COST_FIELDS = (("per_step", "per_pass_s"), ("per_token", "per_token_s"))


# How the step grid is measured (profiler/run.py). 2: each timed step follows a step of its own
# width. 3: each width's time is its median ratio to the narrowest width within a pass, times the
# narrowest width's median. A cached profile measured by an older method is measured again.
PROFILE_VERSION = 3


class Profile(BaseModel):
    version: int = PROFILE_VERSION
    fingerprint: Fingerprint
    ceilings: CeilingsModel
    cost: CostConstants
    latency_model: dict
    fit: FitError
    draft_costs: dict[str, DraftCost] = {}
    max_batch: int
    max_tokens_per_seq: int
    grid_file: str | None = None  # raw grid (parquet), relative to the profile

    @field_validator("draft_costs", mode="before")
    @classmethod
    def _rename_old_draft_cost_fields(cls, costs: Any) -> Any:
        if not isinstance(costs, dict):
            return costs
        renamed = dict(_OLD_DRAFT_COST_FIELDS)
        return {proposer: {renamed.get(k, k): v for k, v in cost.items()} if isinstance(cost, dict) else cost
                for proposer, cost in costs.items()}

    def model(self) -> HingeLatencyModel:
        return HingeLatencyModel.from_dict(self.latency_model)

    def roofline(self) -> LinearRoofline:
        """The step's analytic intensity from the cost constants (verify steps: every query token
        gets a row of logits, so the LM head is priced per token)."""
        c = self.cost
        return LinearRoofline(ridge=self.ceilings.ridge, flops_per_token=c.flops_per_token + c.lm_head_flops_per_row,
                              bytes_per_step=c.weight_bytes, bytes_per_context_token=c.kv_bytes_per_token,
                              attention_flops=c.attention_flops_per_token_pair)

    def predict(self, shape: StepShape) -> float:
        return self.model().predict(shape)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)  # atomic: a crash never leaves half a profile

    @staticmethod
    def load(path: Path | str) -> "Profile":
        path = Path(path)
        remedy = "make a fresh one with `specplan profile --quick`"
        if not path.exists():
            raise ProfileError(f"profile {path} does not exist; {remedy}")
        try:
            return Profile.model_validate_json(path.read_text())
        except (ValidationError, json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ProfileError(f"profile {path} is corrupted or truncated ({first}); {remedy}") from None


def refit_profile(path: Path | str) -> Profile:
    """The profile at ``path`` with its latency model fitted again to the grid it measured (the
    ``grid_file`` beside it), by this version's fit: a profile made before a change to the fit's
    form gets the new form without timing anything again. Fit errors are recomputed; the
    ceilings, costs and fingerprint are kept. ProfileError (one line) if the grid is missing."""
    import pandas as pd

    from .fit import fit_grid

    path = Path(path)
    profile = Profile.load(path)
    grid_path = path.parent / profile.grid_file if profile.grid_file else None
    if grid_path is None or not grid_path.exists():
        raise ProfileError(f"profile {path} has no measured grid beside it ({grid_path or 'none recorded'}); "
                           f"measure it again with `specplan profile`")
    fitted = fit_grid(pd.read_parquet(grid_path))
    fit = profile.fit.model_copy(update={"heldout_mape": fitted.heldout_mape, "num_heldout": fitted.num_heldout,
                                         "train_mape": fitted.train_mape})
    return profile.model_copy(update={"latency_model": fitted.model.to_dict(), "fit": fit})


def model_config_hash(model_config) -> str:
    """What identifies a model's shape in a fingerprint: a hash of its ModelConfig, name aside
    (the vLLM plugin compares it with the model vLLM serves)."""
    import hashlib

    from dataclasses import asdict

    cfg = asdict(model_config)
    cfg.pop("name", None)
    cfg.pop("quantization", None)  # the weights' format is part of the dtype (fingerprint)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(model_config, dtype: torch.dtype, device: str, kv_dtype: torch.dtype | None = None) -> Fingerprint:
    """What a profile was measured on. ``kv_dtype``: the KV cache's as requested (None: the
    engine's auto choice for this model, which is what the fingerprint records)."""
    from specplan.engine.model_runner import kv_cache_dtype

    # A quantized engine is another machine: its own profile (dtype "float32-q4_1+q8_0").
    quant = getattr(model_config, "quantization", None)
    dtype_name = str(dtype).removeprefix("torch.") + (f"-{quant}" if quant else "")
    kv = str(kv_cache_dtype(model_config, dtype, device, kv_dtype)).removeprefix("torch.")
    return Fingerprint(model=model_config.name, model_config_hash=model_config_hash(model_config),
                       dtype=dtype_name, device=str(device), threads=torch.get_num_threads(),
                       torch_version=torch.__version__, cpu=cpu_name(), kernels=_kernels(device), kv_cache=kv)


def _kernels(device: str) -> str:
    from specplan.engine.model.cpu_kernels import build_id

    return build_id() if torch.device(device).type == "cpu" else torch.device(device).type


def check_matches(profile: Profile, current: Fingerprint, path: Path | str) -> list[str]:
    """Raise ProfileError if the profile was measured for another model/device; return warnings."""
    bad = profile.fingerprint.mismatches(current)
    if bad:
        detail = ", ".join(f"{f}: profile {getattr(profile.fingerprint, f)!r} vs now {getattr(current, f)!r}" for f in bad)
        raise ProfileError(f"profile {path} does not match what is being served ({detail}); "
                           f"make a fresh one with `specplan profile --quick`")
    warnings = []
    for f in ("torch_version", "cpu", "kernels", "kv_cache"):
        if getattr(profile.fingerprint, f) != getattr(current, f):
            warnings.append(f"profile {path} was measured with {f} {getattr(profile.fingerprint, f)!r}, "
                            f"now {getattr(current, f)!r}: timings may be off (the planner corrects drift online)")
    return warnings
