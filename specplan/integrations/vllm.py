"""specplan's planner inside vLLM: a ``custom_class`` drafter that chooses k per request per step.

Use (vLLM 0.32, V1 engine; the plugin is imported only by vLLM, never by specplan itself)::

    LLM(model=..., speculative_config={"method": "custom_class",
                                       "model": "specplan.integrations.vllm.SpecplanProposer",
                                       "num_speculative_tokens": 8})

vLLM builds ``SpecplanProposer(vllm_config)`` in its worker and calls ``propose`` after every
step. Each call the plugin (1) reads the batch's rows (specplan/integrations/vllm_rows.py: which
request is which, what the step committed), (2) tells the planner what the step that just ran
did, as the built-in engine does: per request drafts asked / proposed / accepted (accepted =
committed tokens - 1), the match length, the step's wall time (from one call to the next; the
plugin's own time is reported as propose time, the rest as forward time: vLLM shows no split),
batch size and query tokens, (3) looks every decoding request up in specplan's n-gram index (the
engine's ``NgramIndex``: one implementation) and (4) asks the planner's policy for k per
request, returning that many drafts each (0..K; [] = the request does not speculate).

vLLM passes nothing but ``vllm_config``, so specplan's options come from the environment:

    SPECPLAN_POLICY       the decision rule, as ``specplan --policy`` spells it (default goodput;
                          static:K, batch_table, heuristic need no profile)
    SPECPLAN_PROFILE      a Profile JSON (``specplan profile``); required by goodput and roofline
    SPECPLAN_SLA_ITL_MS   the ITL SLA in ms: predicted steps stay under it
    SPECPLAN_MAX_K        the planner's cap on drafts per request (default: the profile's deepest
                          measured k, at most 8; without a profile, vLLM's K, at most 8); vLLM's
                          num_speculative_tokens must be >= it
    SPECPLAN_WORKLOAD     the workload tag for pooled acceptance priors (default "default")
    SPECPLAN_VLLM_STATS   a JSON file the plugin rewrites after every call with its counters
                          (calls, drafts proposed and accepted, its own seconds): for tests and
                          benchmarks, whose vLLM runs the plugin in another process

Limits (vLLM's drafter sees no sampling parameters and no request ids): every request is taken
as greedy for the priors (the pooled beliefs learn the real acceptance), a request's identity is
inferred from its tokens, and a step's prefill tokens from the slot mapping's length.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from specplan.engine.decider import RequestRecord, RequestView, StepRecord, StepView
from specplan.planner import Planner, PlannerConfig, planner_from_profile
from specplan.policies import make_policy

from .vllm_rows import BatchRows, LookupConfig, RowTracker

log = logging.getLogger("specplan.vllm")

# The vLLM releases whose ``custom_class`` door (propose's arguments, what sampled_token_ids
# holds) this plugin was built and tested against: (major, minor).
SUPPORTED_VLLM = ((0, 32),)
PROPOSER = "ngram"


class PluginConfigError(ValueError):
    """A setting the plugin cannot run with; the message is one line with the fix."""


@dataclass(frozen=True)
class PluginOptions:
    policy: str = "goodput"
    profile: str | None = None
    sla_itl_ms: float | None = None
    max_k: int | None = None
    workload: str = "default"
    stats_path: str | None = None

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> "PluginOptions":
        def number(name: str, kind: type, low: float) -> Any:
            text = env.get(name)
            if text is None or text == "":
                return None
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not value >= low or (kind is float and not math.isfinite(value)):
                raise PluginConfigError(f"{name}={text!r} is not a {kind.__name__} >= {low:g}; fix or unset it")
            return value

        return PluginOptions(policy=env.get("SPECPLAN_POLICY") or "goodput", profile=env.get("SPECPLAN_PROFILE") or None,
                             sla_itl_ms=number("SPECPLAN_SLA_ITL_MS", float, 1e-9),
                             max_k=number("SPECPLAN_MAX_K", int, 0),
                             workload=env.get("SPECPLAN_WORKLOAD") or "default",
                             stats_path=env.get("SPECPLAN_VLLM_STATS") or None)


def check_vllm_version(version: str) -> None:
    """Raise PluginConfigError unless ``version`` is a vLLM release this plugin supports."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major = minor = -1
    if (major, minor) not in SUPPORTED_VLLM:
        wanted = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise PluginConfigError(f"specplan's vLLM plugin supports vLLM {wanted}.x, found {version}; "
                                f"install a supported release (pip install 'vllm=={SUPPORTED_VLLM[-1][0]}."
                                f"{SUPPORTED_VLLM[-1][1]}.*') or drop the custom_class speculative_config")


def load_profile(path: str, hf_config: Any, dtype: str) -> tuple[Any, list[str]]:
    """The profile at ``path`` if it is for the model vLLM serves, and warnings (another engine, dtype).
    Raises ProfileError (one line) for a missing, corrupt or other model's profile."""
    from specplan.engine.config import ModelConfig
    from specplan.profiler.profile import Profile, ProfileError, model_config_hash

    profile = Profile.load(path)
    fp = profile.fingerprint
    try:
        served = model_config_hash(ModelConfig.from_hf(hf_config))
    except Exception as e:  # an architecture specplan's engine does not know: no profile can be this model's
        served = f"unknown ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if fp.model_config_hash != served:
        raise ProfileError(f"profile {path} was measured for another model ({fp.model}, config {fp.model_config_hash}; "
                           f"vLLM serves config {served}); profile this model: `specplan profile --model DIR`")
    warnings = []
    if not fp.kernels.startswith("vllm"):
        warnings.append(f"profile {path} timed specplan's engine (kernels {fp.kernels}), not vLLM: its step times are "
                        f"another engine's; the planner corrects drift online, a vLLM profile would plan better")
    if fp.dtype != dtype:
        warnings.append(f"profile {path} was measured in {fp.dtype}, vLLM runs {dtype}: timings may be off")
    return profile, warnings


def build_planner(options: PluginOptions, *, num_speculative_tokens: int, hf_config: Any = None,
                  dtype: str = "float32") -> Planner:
    """The planner the plugin steers with; PluginConfigError / ProfileError (one line) on bad input."""
    try:
        policy = make_policy(options.policy)
    except ValueError as e:
        raise PluginConfigError(f"SPECPLAN_POLICY={options.policy!r}: {e}") from None
    profile = None
    if options.profile is not None:
        profile, warnings = load_profile(options.profile, hf_config, dtype)
        for w in warnings:
            log.warning("specplan: %s", w)
    elif "latency" in policy.requires or "roofline" in policy.requires:
        raise PluginConfigError(f"policy {policy.name!r} needs a latency profile of this model: set "
                                f"SPECPLAN_PROFILE=PATH (from `specplan profile`; `specplan profile --engine vllm` "
                                f"is coming), or SPECPLAN_POLICY=static:K / batch_table / heuristic, which need none")
    max_k = options.max_k
    if max_k is None and profile is None:  # nothing asks for more than vLLM's K
        max_k = min(PlannerConfig.max_k, num_speculative_tokens)
    source = "SPECPLAN_MAX_K"
    if max_k is None:
        max_k = max(0, min(PlannerConfig.max_k, profile.max_tokens_per_seq - 1))
        source = f"the profile measured steps up to k = {profile.max_tokens_per_seq - 1}"
    if num_speculative_tokens < max_k:
        raise PluginConfigError(f"vLLM's num_speculative_tokens={num_speculative_tokens} is below the {max_k} drafts "
                                f"the planner may ask for ({source}); set num_speculative_tokens={max_k} (the planner "
                                f"turns speculation down itself) or SPECPLAN_MAX_K={num_speculative_tokens}")
    sla = options.sla_itl_ms / 1000 if options.sla_itl_ms is not None else None
    return planner_from_profile(profile, policy, proposer=PROPOSER, sla_itl_s=sla, max_k=max_k)


@dataclass
class DrafterStats:
    """The plugin's counters (written to SPECPLAN_VLLM_STATS): what it did and what it cost."""

    calls: int = 0
    request_steps: int = 0  # decoding rows over all calls
    drafts_proposed: int = 0
    drafts_accepted: int = 0  # of drafts proposed for steps that have run
    steps_observed: int = 0  # step records given to the planner
    own_s: float = 0.0  # seconds inside propose, all calls
    own_s_max: float = 0.0
    max_batch: int = 0


class PlanningDrafter:
    """The plugin's engine-agnostic core: vLLM's arrays in, drafts out, the planner in between.

    planner: any SpecDecider-like planner (decide(StepView), observe(StepRecord)).
    num_speculative_tokens: vLLM's K, the most drafts a request may get.
    max_model_len: no request is given drafts past it.
    max_num_batched_tokens: the step's token budget (the planner's draft budget), or None.
    """

    def __init__(self, planner: Any, num_speculative_tokens: int, max_model_len: int,
                 max_num_batched_tokens: int | None = None, lookup: LookupConfig = LookupConfig(),
                 stats_path: str | None = None):
        self.planner = planner
        self.k = num_speculative_tokens
        self.planner_max_k = getattr(getattr(planner, "config", None), "max_k", num_speculative_tokens)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookup = lookup
        self.rows = RowTracker(lookup)
        self.stats = DrafterStats()
        self.stats_path = Path(stats_path) if stats_path else None
        self._prev_start: float | None = None  # perf_counter at the previous call's start
        self._prev_own_s = 0.0  # the previous call's own seconds

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Drafts per row of vLLM's batch ([] = none). Shapes as vLLM passes them:
        sampled_token_ids [num_rows] lists, num_tokens_no_spec [>= num_rows],
        token_ids_cpu [>= num_rows, max_model_len]."""
        start = time.perf_counter()
        batch = self.rows.read(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        # A step is comparable when a request ran through it: the time since the previous call
        # then is one step, not an idle gap before the first request of a new burst.
        if self._prev_start is not None and any(r.continued for r in batch.decodes):
            self.planner.observe(self._record(batch, start - self._prev_start, slot_mappings))
            self.stats.steps_observed += 1
        out: list[list[int]] = [[] for _ in range(batch.num_rows)]
        if batch.decodes:
            self._draft(batch, out)
        own = time.perf_counter() - start
        self._prev_start, self._prev_own_s = start, own
        st = self.stats
        st.calls += 1
        st.own_s += own
        st.own_s_max = max(st.own_s_max, own)
        st.max_batch = max(st.max_batch, batch.num_rows)
        if self.stats_path is not None:  # a debugging aid: its cost is not counted in own_s
            self._write_stats()
        return out

    def _record(self, batch: BatchRows, total_s: float, slot_mappings: Any) -> StepRecord:
        """The step that just ran, as the built-in engine reports one (engine/decider.py)."""
        reqs, decode_tokens, context = [], 0, 0
        new_prompt_tokens = 0
        for r in batch.decodes:
            t = r.request
            prev_len = t.num_tokens - r.num_sampled  # committed before the step
            if not r.continued:  # its prompt (or last chunk of it) ran in this step
                new_prompt_tokens += prev_len
                context += prev_len
                continue
            decode_tokens += 1 + t.proposed
            context += prev_len + 1 + t.proposed
            reqs.append(RequestRecord(t.seq_id, str(t.seq_id), t.asked, t.proposed, r.num_accepted, r.num_sampled,
                                      t.natural_k, t.match_length))
            self.stats.drafts_accepted += r.num_accepted
        total_tokens = _scheduled_tokens(slot_mappings)
        prefill_tokens = (max(0, total_tokens - decode_tokens) if total_tokens is not None
                          else new_prompt_tokens + len(batch.prefill_rows))
        own = min(self._prev_own_s, total_s)
        return StepRecord(requests=tuple(reqs), num_seqs=batch.num_rows, num_tokens=decode_tokens + prefill_tokens,
                          num_prefill_tokens=prefill_tokens, context_tokens=context + prefill_tokens,
                          propose_s=own, forward_s=total_s - own, verify_s=0.0, total_s=total_s)

    def _draft(self, batch: BatchRows, out: list[list[int]]) -> None:
        """Look every decoding row up, ask the planner for k per row, fill ``out``."""
        cap_all = min(self.k, self.planner_max_k)
        views, found = [], []
        context = 0
        for r in batch.decodes:
            t = r.request
            n = t.num_tokens
            context += n
            cap = max(0, min(cap_all, self.max_model_len - n - 1))
            drafts, available, match_length = t.index.lookup(cap) if cap else ([], 0, 0)
            found.append((drafts, available, match_length))
            views.append(RequestView(t.seq_id, str(t.seq_id), n, n - t.first_len + 1, len(drafts), True,
                                     len(drafts), match_length))
        budget = (max(0, self.max_num_batched_tokens - len(views) - len(batch.prefill_rows))
                  if self.max_num_batched_tokens is not None else None)
        view = StepView(requests=tuple(views), num_prefill_tokens=0, num_prefill_seqs=len(batch.prefill_rows),
                        context_tokens=context, proposer=PROPOSER, draft_budget=budget)
        ks = self.planner.decide(view)
        st = self.stats
        st.request_steps += len(views)
        for r, k, (drafts, available, match_length) in zip(batch.decodes, ks, found):
            t = r.request
            k = max(0, min(int(k), len(drafts)))
            t.asked, t.proposed = k, k
            t.natural_k = min(available, self.lookup.max_natural_k) if k else None
            t.match_length = match_length if k else None
            if k:
                out[r.row] = drafts[:k]
                st.drafts_proposed += k

    def _write_stats(self) -> None:
        tmp = self.stats_path.with_suffix(self.stats_path.suffix + ".tmp")
        tmp.write_text(json.dumps({**asdict(self.stats), "pid": os.getpid()}))
        tmp.replace(self.stats_path)  # readers never see half a file


def _scheduled_tokens(slot_mappings: Any) -> int | None:
    """The step's query tokens: vLLM's slot mapping holds one slot per scheduled token (per layer
    name, or per micro-batch); None when it is absent or of another shape."""
    if isinstance(slot_mappings, list):
        parts = [_scheduled_tokens(m) for m in slot_mappings]
        return sum(parts) if parts and None not in parts else None
    if isinstance(slot_mappings, dict) and slot_mappings:
        shape = getattr(next(iter(slot_mappings.values())), "shape", None)
        return int(shape[0]) if shape else None
    return None


class SpecplanProposer(PlanningDrafter):
    """What vLLM instantiates: ``speculative_config={"method": "custom_class", "model":
    "specplan.integrations.vllm.SpecplanProposer", "num_speculative_tokens": K}``."""

    def __init__(self, vllm_config: Any):
        import vllm

        check_vllm_version(vllm.__version__)
        options = PluginOptions.from_env()
        spec = vllm_config.speculative_config
        model = vllm_config.model_config
        k = int(spec.num_speculative_tokens)
        planner = build_planner(options, num_speculative_tokens=k, hf_config=model.hf_config,
                                dtype=str(model.dtype).removeprefix("torch."))
        super().__init__(planner, k, int(model.max_model_len),
                         getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None),
                         stats_path=options.stats_path)
        log.info("specplan: planning speculation with policy %s (max_k %d, vLLM K %d)", options.policy,
                 planner.config.max_k, k)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_: Any):
        return super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM asks every drafter to load its model; a lookup has none."""
