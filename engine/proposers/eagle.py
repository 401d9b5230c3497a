"""EAGLE-3 draft head proposer: one small decoder layer that drafts from the target's own features.

The head (Li et al., "EAGLE-3", 2025; vLLM's ``llama_eagle3.py``) reads what the target already
computed: the residual stream entering three of its layers (low, middle, high: 2, 15, 27 of
SmolLM2-135M's 30), concatenated [3 * hidden] and fused by ``fc`` to [hidden]. At head position p
it takes that fused feature of target position p and the embedding of token p + 1, and predicts
token p + 2:

    x = [input_norm(embed(t_{p+1})) ; hidden_norm(f_p)]            # [2 * hidden]
    h = f_p + o(attn(qkv(x)))                                       # residual: f_p itself
    h = h + mlp(post_norm(h))                                       # h: the "prenorm" output
    logits_draft = lm_head(norm(h))                                 # [draft_vocab]

Its output layer covers a reduced draft vocabulary (the target's most frequent tokens); draft id
i is target token ``i + d2t[i]`` and ``t2d[t]`` says whether target token t has a draft id (the
layout vLLM and the ``speculators`` library store). For k > 1 the head chains on its own output:
draft step s (s >= 1) at position c - 1 + s reads the prenorm h of the previous step instead of a
target feature, and the token it drafted.

Head KV bookkeeping (one layer, in the engine's paged pool, indexed by the target's block tables
so the same lookahead reservation covers it). After a step the target has computed positions
< c (c = ``seq.num_computed_tokens``) and the sequence holds token c (the bonus). The head's K/V
at positions < c are "catch-up" entries, from target features; drafting writes own-feature
entries at positions c .. c + k - 2, which the next catch-up overwrites. So a proposal:

    catch-up: positions valid .. c - 1 (features f_p from the target, tokens t_{p+1})  -> draft 1
    step s:   position c - 1 + s (the previous step's h, draft s)                       -> draft s + 1

with ``valid`` the first position not yet fed from target features (0 for a new or preempted
sequence). The target's features arrive after every forward (``observe_target``), also on steps
where the decider chose k = 0. A prompt chunk's are fed to the head in the step that computed
them (all but the prompt's last position, whose next token is not sampled yet); a decode step's
wait in a per-sequence queue until the head next drafts, so its cache is always brought current
before it is read and nothing runs while k = 0.

Checkpoint: a folder with ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``, Llama fields) and
``model.safetensors`` with vLLM's eagle3 names (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``); the embedding is the target's (not stored). specplan adds a
``specplan`` block: the target's fingerprint (checked at load), the training command and data.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..block_manager import BlockManager
from ..config import ModelConfig
from ..decider import DraftStop
from ..drafts import DraftTokens
from ..model.attention import AttentionPlan, paged_attention
from ..model.attention_cpu import paged_attention_cpu
from ..model.attention_cpu import supports as cpu_kernel_supports
from ..model.linear import make_linear, packed_available
from ..model.quant import QuantWeight
from ..model.transformer import Model
from ..model_runner import ModelRunner, ScheduledSeq
from ..sampling import probabilities, sample_from
from ..sequence import Sequence

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# The heads shipped inside the package, one folder each (see ``shipped_head_for``).
SHIPPED_HEADS = Path(__file__).parent / "heads"
# Parameter names and shapes in vLLM's eagle3 layout (H hidden, I intermediate, D head dim).
LAYER_WEIGHTS = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                 "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                 "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                 "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")


class HeadError(ValueError):
    """A head that cannot serve this target (another model or vocabulary, a corrupt file); the
    message is one line saying what is wrong and what to do."""


@dataclass(frozen=True)
class HeadConfig:
    """What config.json says about a head (the Llama fields it shares with its target)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layers: tuple[int, ...]  # eagle_aux_hidden_state_layer_ids
    target_fingerprint: dict | None = None  # specplan's check that the head fits the target

    @staticmethod
    def for_target(target: ModelConfig, draft_vocab_size: int, target_layers: tuple[int, ...]) -> "HeadConfig":
        return HeadConfig(target.hidden_size, target.intermediate_size, target.num_heads, target.num_kv_heads,
                          target.head_dim, target.rms_norm_eps, target.vocab_size, draft_vocab_size,
                          tuple(target_layers))

    def to_json(self, target: ModelConfig, extra: dict) -> dict:
        """config.json in the layout vLLM loads for ``method: eagle3``, plus specplan's block."""
        rope_theta = 1.0 / target.rope_inv_freq[1] ** (self.head_dim / 2) if len(target.rope_inv_freq) > 1 else 10000.0
        return {
            "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "max_position_embeddings": target.max_position_embeddings, "rope_theta": round(rope_theta, 3),
            "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": None,
            "eos_token_id": list(target.eos_token_ids) or None,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layers),
                             "use_aux_hidden_state": True},
            "eagle_aux_hidden_state_layer_ids": list(self.target_layers),
            "specplan": {"target_fingerprint": self.target_fingerprint, **extra},
        }

    @staticmethod
    def from_json(doc: dict, where: str) -> "HeadConfig":
        archs = doc.get("architectures") or []
        if EAGLE3_ARCHITECTURE not in archs:
            raise HeadError(f"{where} is not an EAGLE-3 head (architectures {archs}, expected "
                            f"{EAGLE3_ARCHITECTURE!r}); pass a folder written by `specplan train-draft`")
        try:
            layers = doc.get("eagle_aux_hidden_state_layer_ids") or \
                (doc.get("eagle_config") or {})["eagle_aux_hidden_state_layer_ids"]
            heads = int(doc["num_attention_heads"])
            return HeadConfig(
                hidden_size=int(doc["hidden_size"]), intermediate_size=int(doc["intermediate_size"]),
                num_heads=heads, num_kv_heads=int(doc.get("num_key_value_heads") or heads),
                head_dim=int(doc.get("head_dim") or int(doc["hidden_size"]) // heads),
                rms_norm_eps=float(doc["rms_norm_eps"]), vocab_size=int(doc["vocab_size"]),
                draft_vocab_size=int(doc.get("draft_vocab_size") or doc["vocab_size"]),
                target_layers=tuple(int(i) for i in layers),
                target_fingerprint=(doc.get("specplan") or {}).get("target_fingerprint"))
        except (KeyError, TypeError, ValueError) as e:
            raise HeadError(f"{where} lacks a valid field ({type(e).__name__}: {e}); "
                            f"write the head again with `specplan train-draft`") from None


def target_fingerprint(config: ModelConfig, embed: torch.Tensor) -> dict:
    """Shape facts and two sums over the first 256 embedding rows: a head trained on another
    model's features is told apart even when the shapes match (a base vs an instruct model)."""
    rows = embed[:256].double()  # [256, H]
    return {"name": config.name, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_layers": config.num_layers, "embed_sum": round(float(rows.sum()), 4),
            "embed_abs_sum": round(float(rows.abs().sum()), 4)}


def check_fits(config: HeadConfig, target: ModelConfig, embed: torch.Tensor, where: str) -> None:
    """Raises HeadError when the head was made for another model, size or vocabulary."""
    if config.vocab_size != target.vocab_size:
        raise HeadError(f"{where} was trained for a vocabulary of {config.vocab_size} tokens, this model has "
                        f"{target.vocab_size}; train a head for it with `specplan train-draft`")
    if config.hidden_size != target.hidden_size or config.head_dim != target.head_dim:
        raise HeadError(f"{where} has hidden size {config.hidden_size} (head dim {config.head_dim}), this model "
                        f"{target.hidden_size} ({target.head_dim}); train a head for it with `specplan train-draft`")
    if not config.target_layers or not all(0 <= i < target.num_layers for i in config.target_layers) \
            or list(config.target_layers) != sorted(set(config.target_layers)):
        raise HeadError(f"{where} reads target layers {list(config.target_layers)}, this model has "
                        f"{target.num_layers}; train a head for it with `specplan train-draft`")
    fp = config.target_fingerprint
    if fp is not None:
        mine = target_fingerprint(target, embed)
        close = all(abs(fp[k] - mine[k]) <= 1e-3 * max(1.0, abs(mine[k])) for k in ("embed_sum", "embed_abs_sum"))
        if not close or fp.get("num_layers") != target.num_layers:
            raise HeadError(f"{where} was trained for another model ({fp.get('name')!r}) than {target.name!r} "
                            f"(their embeddings differ); train a head for it with `specplan train-draft`")


def read_head(path: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a head folder, checked for completeness and shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise HeadError(f"{d} is not a draft head folder (needs config.json and model.safetensors); "
                        f"pass a folder written by `specplan train-draft`")
    try:
        doc = json.loads((d / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadError(f"{d / 'config.json'} is not valid JSON ({e}); write the head again") from None
    config = HeadConfig.from_json(doc, str(d))
    try:
        weights = load_file(str(d / "model.safetensors"))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise HeadError(f"{d / 'model.safetensors'} is corrupt or unreadable ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); write the head again") from None
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    expected = {
        "fc.weight": (c.hidden_size, len(c.target_layers) * c.hidden_size),
        "midlayer.input_layernorm.weight": (c.hidden_size,), "midlayer.hidden_norm.weight": (c.hidden_size,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * c.hidden_size),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * c.hidden_size),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * c.hidden_size),
        "midlayer.self_attn.o_proj.weight": (c.hidden_size, q),
        "midlayer.post_attention_layernorm.weight": (c.hidden_size,),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "midlayer.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        "norm.weight": (c.hidden_size,), "lm_head.weight": (c.draft_vocab_size, c.hidden_size),
        "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,),
    }
    for name, shape in expected.items():
        if name not in weights:
            raise HeadError(f"{d / 'model.safetensors'} lacks {name!r}; write the head again with `specplan train-draft`")
        if tuple(weights[name].shape) != shape:
            raise HeadError(f"{d / 'model.safetensors'}: {name} has shape {tuple(weights[name].shape)}, "
                            f"config.json implies {shape}; the files do not belong together")
    ids = torch.arange(c.draft_vocab_size) + weights["d2t"].long()  # [Vd] target ids
    if ids.min() < 0 or ids.max() >= c.vocab_size or not bool(weights["t2d"].bool()[ids].all()) \
            or int(weights["t2d"].bool().sum()) != c.draft_vocab_size:
        raise HeadError(f"{d / 'model.safetensors'}: d2t and t2d disagree or leave the vocabulary; "
                        f"write the head again with `specplan train-draft`")
    if not all(torch.isfinite(t.float()).all() for t in weights.values() if t.is_floating_point()):
        raise HeadError(f"{d / 'model.safetensors'} holds NaN or infinite weights; train the head again")
    return config, weights


def write_head(path: str | Path, config_json: dict, weights: dict[str, torch.Tensor]) -> Path:
    """Write a head folder (floating weights in fp16, d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    out = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous().cpu()
           for k, v in weights.items()}
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config_json, indent=1) + "\n")
    return d


def shipped_head_for(target: ModelConfig, embed: torch.Tensor) -> Path:
    """The head shipped with specplan for this target (matched by fingerprint), else HeadError."""
    for d in sorted(SHIPPED_HEADS.glob("*/config.json")) if SHIPPED_HEADS.is_dir() else []:
        try:
            config = HeadConfig.from_json(json.loads(d.read_text()), str(d.parent))
            check_fits(config, target, embed, str(d.parent))
        except (HeadError, json.JSONDecodeError):
            continue
        return d.parent
    raise HeadError(f"no draft head ships for {target.name!r}; train one with `specplan train-draft` and pass "
                    f"--draft-head DIR")


class EagleHead:
    """The head, ready to run (the engine's linears and fused ops; the target's embedding and RoPE)."""

    def __init__(self, config: HeadConfig, weights: dict[str, torch.Tensor], target: Model,
                 weight_format: str = "q8_0"):
        self.config = config
        device, dtype = target.device, target.dtype
        packed = packed_available(device, dtype)
        # A draft pass streams every projection once for a row or two, right after the target's
        # step has pushed them out of cache: in Q8_0 blocks it reads 3.8x fewer bytes (the
        # drafts are proposals: their numerics change acceptance, never the output).
        self.weight_format = weight_format if packed else "fp32"

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def linear(*names: str):
            weight = torch.cat([w(n) for n in names])
            if self.weight_format == "q8_0":
                weight = QuantWeight.quantize(weight, "q8_0")
            return make_linear(weight, None, packed)

        p = "midlayer."
        self.fc = linear("fc.weight")  # 3H -> H
        self.input_norm = w(p + "input_layernorm.weight")  # [H]
        self.hidden_norm = w(p + "hidden_norm.weight")  # [H]
        self.qkv = linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))  # 2H -> (Hq + 2 KVH) D
        self.o = linear(p + "self_attn.o_proj.weight")
        self.post_norm = w(p + "post_attention_layernorm.weight")
        self.gate_up = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.down = linear(p + "mlp.down_proj.weight")
        self.norm = w("norm.weight")
        self.lm_head = linear("lm_head.weight")  # H -> Vd
        self.draft_to_target = (torch.arange(config.draft_vocab_size) + weights["d2t"].long()).to(device)  # [Vd]
        self.embed, self.rope_cos, self.rope_sin, self.ops = target.embed, target.rope_cos, target.rope_sin, target.ops
        self.device, self.dtype = device, dtype
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self.sliding_window = target.config.sliding_window
        # The config the head's one layer of K/V is sized and allocated by (the target's shape).
        self.kv_config = dataclasses.replace(target.config, num_layers=1, name=f"{target.config.name}[eagle]")

    @staticmethod
    def load(path: str | Path | None, target: Model, weight_format: str = "q8_0") -> "EagleHead":
        """The head in folder ``path`` (None: the one shipped for this target); HeadError if it
        does not fit the target."""
        d = Path(path) if path is not None else shipped_head_for(target.config, target.embed)
        config, weights = read_head(d)
        check_fits(config, target.config, target.embed, str(d))
        return EagleHead(config, weights, target, weight_format)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.config.target_layers

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        """captured [N, 3H] (the target's layers, ``Model.forward_capturing``) -> features [N, H]."""
        return self.fc(captured)

    @torch.inference_mode()
    def forward(self, batch, features: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """features [N, H] (fused target features or the previous step's prenorm h) with the
        batch's tokens -> (normed [N, H] for the logits, prenorm h [N, H] for the next step);
        writes the head's K/V at the batch's slots."""
        c, ops = self.config, self.ops
        h = features.clone()  # [N, H] the residual (updated in place)
        e = self.embed[batch.input_ids]  # [N, H]
        x = torch.cat([ops.add_rms_norm_(e, None, self.input_norm, self.eps),
                       ops.add_rms_norm_(h, None, self.hidden_norm, self.eps)], dim=-1)  # [N, 2H]
        k_cache, v_cache = kv
        q = ops.rope_write_kv(self.qkv(x), batch.positions, self.rope_cos, self.rope_sin, k_cache, v_cache,
                              batch.slot_mapping, c.num_heads, c.num_kv_heads)  # [N, Hq, D]
        if cpu_kernel_supports(batch, self.dtype, self.device):
            attn = paged_attention_cpu(q, k_cache, v_cache, batch, self.scale, self.sliding_window)
        else:
            plan = AttentionPlan.build(batch, block_size, c.num_heads // c.num_kv_heads, self.sliding_window)
            attn = paged_attention(q, k_cache, v_cache, plan, self.scale)  # [N, Hq, D]
        x = ops.add_rms_norm_(h, self.o(attn.reshape(len(h), -1)), self.post_norm, self.eps)  # [N, H]
        normed = ops.add_rms_norm_(h, self.down(ops.silu_mul(self.gate_up(x))), self.norm, self.eps)
        return normed, h

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [R, H] -> logits over the draft vocabulary [R, Vd], fp32."""
        return self.lm_head(normed).float()

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[R, Vd] -> [R, V]: -inf where the target token has no draft id (q = 0 there)."""
        full = torch.full((draft_logits.shape[0], self.config.vocab_size), float("-inf"),
                          dtype=draft_logits.dtype, device=draft_logits.device)
        full[:, self.draft_to_target] = draft_logits
        return full


@dataclass
class _Features:
    """A sequence's fused target features not yet fed to the head: chunks (first position, [n, H])."""

    chunks: list[tuple[int, torch.Tensor]]

    @property
    def end(self) -> int:
        start, rows = self.chunks[-1]
        return start + rows.shape[0]

    def put(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start.. replace what was there (rejected drafts' rows go)."""
        kept = []
        for s, r in self.chunks:
            if s < start:
                kept.append((s, r[:start - s]))
        self.chunks = [c for c in kept if c[1].shape[0]] + [(start, rows)]

    def rows(self, first: int, end: int) -> torch.Tensor | None:
        """[end - first, H] for positions first..end-1, or None if some are missing."""
        parts, at = [], first
        for s, r in self.chunks:
            if s <= at < s + r.shape[0]:
                take = r[at - s:min(end, s + r.shape[0]) - s]
                parts.append(take)
                at += take.shape[0]
        return torch.cat(parts) if at >= end and parts else None

    def drop_before(self, position: int) -> None:
        self.chunks = [(max(s, position), r[max(0, position - s):]) for s, r in self.chunks
                       if s + r.shape[0] > position]


class EagleProposer:
    """Drafts with an EAGLE-3 head; the engine hands it the target's features after each forward."""

    name = "eagle"
    proposes_prefixes = False  # each draft token costs a head forward
    stops_early = True  # takes the decider's DraftStop (proposers/base.py StopsEarly)

    def __init__(self, head: EagleHead, kv: tuple[torch.Tensor, torch.Tensor], batcher: ModelRunner,
                 block_manager: BlockManager, default_generator: torch.Generator):
        self.draft = head  # the name the engine reuses drafters by
        self.head = head
        self.kv = kv  # (k_cache, v_cache) [num_blocks, block_size, KVH, D]: the head's one layer
        self.batcher = batcher  # builds TokenBatches (the target's runner; its model is not run)
        self.block_manager = block_manager
        self.default_generator = default_generator
        self._features: dict[int, _Features] = {}
        self._fed: dict[int, tuple[int, int]] = {}  # seq_id -> (first position not fed from target features, preemptions)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.head.target_layers

    def observe_target(self, work: list[ScheduledSeq], captured: torch.Tensor) -> None:
        """captured [N, 3H]: the target's features for every query token of the forward that ran
        ``work`` (in batch order). Tree nodes past the root are not positions: only root rows kept."""
        fused = self.head.fuse(captured)  # [N, H]
        row = 0
        prompts = []
        for w in work:
            n = len(w.token_ids)
            rows = fused[row:row + n] if w.tree is None else fused[row:row + 1]
            row += n
            sid = w.seq.seq_id
            feats = self._features.get(sid)
            if feats is None or w.start_position > feats.end:
                self._features[sid] = _Features([(w.start_position, rows)])
            else:
                feats.put(w.start_position, rows)
            if n > 1 and w.start_position + n <= w.seq.num_tokens:  # a prompt chunk (drafts are not tokens yet)
                prompts.append(w.seq)
        if prompts:
            self._catch_up_prompts(prompts)

    def _catch_up_prompts(self, seqs: list[Sequence]) -> None:
        """Feed the head a prompt chunk's positions in the step that computed them: one pass over
        all the chunk's rows, while their features are at hand. Caught up at the first proposal
        instead, a 500-token prompt made that step's head pass ~10x a decode pass, and the
        planner's timing learner read it as what a pass costs. Position p needs token p + 1, so
        each prompt's last position waits for the sampled token (the first proposal feeds it)."""
        items, inputs = [], []
        for seq in seqs:
            fed, preemptions = self._fed.get(seq.seq_id, (0, seq.num_preemptions))
            start = fed if preemptions == seq.num_preemptions else 0
            feats = self._features[seq.seq_id]
            end = min(feats.end, seq.num_tokens - 1)  # positions start .. end - 1
            rows = feats.rows(start, end) if end > start else None  # [end - start, H]
            if rows is None:
                continue
            items.append(ScheduledSeq(seq, seq.token_ids[start + 1:end + 1], start, 0))
            inputs.append(rows)
            self._fed[seq.seq_id] = (end, seq.num_preemptions)
            feats.drop_before(end - 1)  # the first proposal feeds position end - 1 again (``_valid``)
        if items:
            batch = self.batcher.build_batch(items, self.block_manager)
            self.head.forward(batch, torch.cat(inputs), self.kv, self.block_manager.block_size)

    def _valid(self, seq: Sequence) -> int:
        fed, preemptions = self._fed.get(seq.seq_id, (0, seq.num_preemptions))
        if preemptions != seq.num_preemptions:  # blocks were freed and reallocated
            return 0
        # At least the last computed position is fed again: its output gives the first draft.
        return min(fed, seq.num_computed_tokens - 1)

    def propose(self, seqs: list[Sequence], k: list[int], stop: DraftStop | None = None) -> DraftTokens:
        """Up to k[i] drafts for sequence i, one head pass per draft position for all the
        sequences still drafting; with ``stop``, sequence i stops at the first draft whose chance
        of being accepted with all before it falls below ``stop.min_gain`` (that draft dropped), and
        a pass after the first runs only while the drafting sequences' chances pay for it
        (engine/decider.py ``DraftStop``)."""
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in seqs]
        reach = [1.0] * len(seqs)  # P(drafts so far all accepted), by stop's calibration
        confidence: list[list[float]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active, items, inputs = [], [], []
        for i, seq in enumerate(seqs):
            c = seq.num_computed_tokens
            feats = self._features.get(seq.seq_id)
            if k[i] <= 0 or feats is None or c < 1:
                continue
            start = max(self._valid(seq), 0)
            rows = feats.rows(start, c)  # [c - start, H]
            if rows is None:  # features missing (should not happen): no drafts rather than wrong ones
                continue
            active.append(i)
            items.append(ScheduledSeq(seq, seq.token_ids[start + 1:c + 1], start, 1))
            inputs.append(rows)
        features = torch.cat(inputs) if inputs else None  # [N, H]
        pass_gain = getattr(stop, "pass_gain", 0.0)
        caught_up = list(active)  # their head K/V is current after the first pass, drafts or not
        passes = 0
        while items:
            passes += 1
            batch = self.batcher.build_batch(items, self.block_manager)
            normed, prenorm = self.head.forward(batch, features, self.kv, self.block_manager.block_size)
            last = batch.logits_indices  # [len(active)] each item's last row
            tokens, conf, probs = self._pick(self.head.draft_logits(normed[last]), [seqs[i] for i in active])
            stopped = set()
            for row, i in enumerate(active):
                if stop is not None:
                    reach[i] *= stop.accept_probability(conf[row])
                    if reach[i] < stop.min_gain:  # not worth verifying, nor drafting past
                        stopped.add(i)
                        continue
                drafts[i].append(tokens[row])
                confidence[i].append(conf[row])
                if probs is not None and not seqs[i].params.greedy:
                    qs[i].append(probs[row])
            keep = [row for row, i in enumerate(active) if i not in stopped and len(drafts[i]) < k[i]]
            if stop is not None and keep and (
                    sum(max(0.0, reach[active[row]] - stop.min_gain) for row in keep) < pass_gain):
                keep = []  # the next pass would cost more than the drafts it could add
            features = prenorm[last][keep]  # [len(keep), H]: each step chains on the head's own h
            active = [active[row] for row in keep]
            items = [ScheduledSeq(seqs[i], [drafts[i][-1]], seqs[i].num_computed_tokens - 1 + len(drafts[i]), 1)
                     for i in active]
        for i in caught_up:
            seq = seqs[i]
            c = seq.num_computed_tokens
            self._fed[seq.seq_id] = (c, seq.num_preemptions)
            self._features[seq.seq_id].drop_before(c - 1)
        draft_probs = None
        if any(qs):
            draft_probs = [torch.stack(q) if q else None for q in qs]  # [k_i, V] each
        return DraftTokens(token_ids=drafts, draft_probs=draft_probs, confidence=confidence,
                           seconds=time.perf_counter() - t0, passes=passes)

    def _pick(self, draft_logits: torch.Tensor, seqs: list[Sequence]
              ) -> tuple[list[int], list[float], torch.Tensor | None]:
        """Per row: the draft token (target id), its probability under the head (the distribution
        it was drawn from: the head's softmax for greedy rows, q for sampled ones), and q [R, V]
        over the full vocabulary when any row samples (None otherwise)."""
        head_probs = draft_logits.softmax(dim=-1)  # [R, Vd]
        conf, best = head_probs.max(dim=-1)  # [R], [R]
        tokens = self.head.draft_to_target[best]  # [R] target ids
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return tokens.tolist(), conf.tolist(), None
        device = draft_logits.device
        params = [s.params for s in seqs]
        probs = probabilities(self.head.full_logits(draft_logits),
                              torch.tensor([p.temperature or 1.0 for p in params], device=device),
                              torch.tensor([p.top_k for p in params], device=device),
                              torch.tensor([p.top_p for p in params], device=device))  # [R, V]
        rows = torch.tensor(sampled, device=device)
        tokens[rows] = sample_from(probs[rows], [seqs[r].generator for r in sampled], self.default_generator)
        conf[rows] = probs[rows, tokens[rows]]
        return tokens.tolist(), conf.tolist(), probs

    def on_finished(self, seq: Sequence) -> None:
        self._features.pop(seq.seq_id, None)
        self._fed.pop(seq.seq_id, None)
