"""Building the proposer an engine was configured with (see ``base.Proposer`` for the interface)."""

from __future__ import annotations

import torch

from ..block_manager import BlockManager
from ..config import EngineConfig, SpecConfig
from ..model.loader import LoadedModel, load_model
from ..model.transformer import Model
from ..config import ModelConfig
from ..model_runner import ModelRunner, allocate_kv_cache, layer_caches
from .base import Proposer
from .draft_model import DraftModel, DraftModelProposer
from .eagle import EagleHead, EagleProposer

PROPOSERS = ("ngram", "suffix", "layer-skip", "draft", "eagle", "chain")
HEAD_PROPOSERS = ("eagle", "chain")  # the ones drafting with an EAGLE-3 head


def make_draft_model(spec: SpecConfig, target: Model, config: EngineConfig,
                     loaded: LoadedModel | None = None) -> DraftModel | EagleHead | None:
    """The drafter for the model-based proposers (a draft model, or an EAGLE-3 head), None for the
    others (``loaded``: a draft model already in memory)."""
    if spec.proposer in HEAD_PROPOSERS:
        return EagleHead.load(spec.draft_head, target, spec.draft_head_weights)
    if spec.proposer == "layer-skip":
        n = spec.draft_layers
        if not 1 <= n < target.config.num_layers:
            raise ValueError(f"draft_layers must be in [1, {target.config.num_layers - 1}], got {n}")
        return DraftModel(target.truncated(n), shares_target_kv=True)
    if spec.proposer == "draft":
        if loaded is None:
            if spec.draft_model is None:
                raise ValueError("the draft proposer needs a draft model (--draft-model PATH)")
            loaded = load_model(spec.draft_model, dtype=config.dtype)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size}) differs from the "
                             f"target's ({target.config.vocab_size}); use a draft from the same family")
        return DraftModel(Model(loaded.config, loaded.weights, target.device, config.dtype), shares_target_kv=False)
    return None


def draft_kv_config(draft: DraftModel | EagleHead | None) -> ModelConfig | None:
    """The shape of the K/V a drafter keeps in the engine's paged pool beside the target's (None:
    none, or the target's own, as a layer-skip draft reads)."""
    if isinstance(draft, EagleHead):
        return draft.kv_config
    if isinstance(draft, DraftModel) and not draft.shares_target_kv:
        return draft.model.config
    return None


def make_proposer(spec: SpecConfig, draft: DraftModel | None, target_runner: ModelRunner,
                  block_manager: BlockManager, default_generator: torch.Generator) -> Proposer:
    if spec.proposer == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(min_n=spec.ngram_min, max_n=spec.ngram_max)
    if spec.proposer == "suffix":
        from .suffix import SuffixProposer

        return SuffixProposer()
    if spec.proposer in ("layer-skip", "draft"):
        assert draft is not None
        if draft.shares_target_kv:
            kv = target_runner.kv_cache[: draft.model.config.num_layers]
        else:
            kv = allocate_kv_cache(draft.model.config, block_manager.num_blocks, block_manager.block_size,
                                   draft.model.dtype, draft.model.device)
        runner = ModelRunner(draft.model, kv, block_manager.block_size)
        return DraftModelProposer(draft, runner, block_manager, default_generator, spec.proposer)
    if spec.proposer in HEAD_PROPOSERS:
        assert isinstance(draft, EagleHead)
        kv = allocate_kv_cache(draft.kv_config, block_manager.num_blocks, block_manager.block_size,
                               draft.dtype, draft.device)
        head = EagleProposer(draft, layer_caches(kv)[0], target_runner, block_manager, default_generator)
        if spec.proposer == "eagle":
            return head
        from .chain import ChainProposer
        from .ngram import NgramProposer

        return ChainProposer(NgramProposer(min_n=spec.ngram_min, max_n=spec.ngram_max), head, spec.chain_min_match)
    raise ValueError(f"unknown proposer {spec.proposer!r}; choose one of {', '.join(PROPOSERS)}")
