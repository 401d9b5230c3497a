"""Analytic cost of one engine step: FLOPs and bytes per layer and component, arithmetic
intensity, roofline time and bound (in the spirit of LLM-Viewer's roofline analysis).

Counting rules (one forward pass over N query tokens from B sequences, sequence i feeding T_i
tokens over a context of L_i keys, R rows of logits):
  * weights are read once per step, whatever N is (that is why decode is memory-bound);
  * attention reads each sequence's K and V for its L_i keys and writes K, V for its T_i tokens;
  * activations are read and written once per matrix product;
  * FLOPs are 2 per multiply-add: a [N, in] x [in, out] product is 2 N in out; attention is
    4 T_i L_i head_dim per query head (QK^T and PV);
  * the LM head runs only on the R rows whose logits are needed;
  * ``itemsize`` is the bytes of an activation, a KV entry and a float weight (norms, embedding
    rows); ``weight_itemsize`` the bytes per weight of the matrix products and the LM head, which
    differ when they are quantized (Q4_1: 0.625, scales and mins included; None: ``itemsize``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specplan.engine import ModelConfig


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    activation_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.weight_bytes + other.weight_bytes,
                    self.kv_bytes + other.kv_bytes, self.activation_bytes + other.activation_bytes)

    def __mul__(self, times: int) -> "Cost":
        return Cost(self.flops * times, self.weight_bytes * times, self.kv_bytes * times,
                    self.activation_bytes * times)

    def roofline_seconds(self, peak_flops: float, bandwidth: float) -> float:
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, ridge: float) -> str:
        return "compute" if self.intensity > ridge else "memory"


def _matmul(n: int, d_in: int, d_out: int, itemsize: int, bias: bool = False,
            weight_itemsize: float | None = None) -> Cost:
    w_item = itemsize if weight_itemsize is None else weight_itemsize
    return Cost(flops=2.0 * n * d_in * d_out,
                weight_bytes=float(d_in * d_out) * w_item + float(d_out if bias else 0) * itemsize,
                activation_bytes=float(n * (d_in + d_out)) * itemsize)


def layer_costs(cfg: ModelConfig, query_lens: list[int], context_lens: list[int],
                itemsize: int = 4, weight_itemsize: float | None = None, kv_itemsize: float | None = None
                ) -> dict[str, Cost]:
    """Cost of one decoder layer by component. context_lens[i]: keys sequence i attends to
    (including its own new tokens). ``kv_itemsize``: bytes of a KV entry when the cache is stored
    narrower than the activations (a float16 cache: 2; None: ``itemsize``)."""
    n = sum(query_lens)
    h, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    attn_flops = sum(4.0 * cfg.num_heads * d * t * l for t, l in zip(query_lens, context_lens))
    kv_item = itemsize if kv_itemsize is None else kv_itemsize
    kv_read = sum(2.0 * kv_size * l for l in context_lens) * kv_item
    kv_write = 2.0 * kv_size * n * kv_item
    return {
        "norms": Cost(flops=2 * 4.0 * n * h, weight_bytes=2.0 * h * itemsize,
                      activation_bytes=2 * 2.0 * n * h * itemsize),
        "qkv_proj": _matmul(n, h, q_size + 2 * kv_size, itemsize, bias=cfg.qkv_bias, weight_itemsize=weight_itemsize),
        "attention": Cost(flops=attn_flops, kv_bytes=kv_read + kv_write,
                          activation_bytes=2.0 * n * q_size * itemsize),
        "o_proj": _matmul(n, q_size, h, itemsize, weight_itemsize=weight_itemsize),
        "gate_up_proj": _matmul(n, h, 2 * cfg.intermediate_size, itemsize, weight_itemsize=weight_itemsize),
        "down_proj": _matmul(n, cfg.intermediate_size, h, itemsize, weight_itemsize=weight_itemsize),
    }


def step_costs(cfg: ModelConfig, query_lens: list[int], context_lens: list[int], logits_rows: int | None = None,
               itemsize: int = 4, weight_itemsize: float | None = None, kv_itemsize: float | None = None
               ) -> dict[str, Cost]:
    """Cost of a whole step by component (all layers summed), plus embedding and LM head."""
    n = sum(query_lens)
    rows = len(query_lens) if logits_rows is None else logits_rows
    costs = {name: c * cfg.num_layers
             for name, c in layer_costs(cfg, query_lens, context_lens, itemsize, weight_itemsize, kv_itemsize).items()}
    # The embedding lookup reads only N rows of the table; a tied LM head re-reads the whole table.
    costs["embedding"] = Cost(weight_bytes=float(n * cfg.hidden_size) * itemsize,
                              activation_bytes=float(n * cfg.hidden_size) * itemsize)
    costs["lm_head"] = _matmul(rows, cfg.hidden_size, cfg.vocab_size, itemsize, weight_itemsize=weight_itemsize) + Cost(
        flops=4.0 * rows * cfg.hidden_size, weight_bytes=float(cfg.hidden_size) * itemsize)  # + final norm
    return costs


def step_cost(cfg: ModelConfig, query_lens: list[int], context_lens: list[int], logits_rows: int | None = None,
              itemsize: int = 4, weight_itemsize: float | None = None, kv_itemsize: float | None = None) -> Cost:
    total = Cost()
    for c in step_costs(cfg, query_lens, context_lens, logits_rows, itemsize, weight_itemsize, kv_itemsize).values():
        total = total + c
    return total


def decode_step_cost(cfg: ModelConfig, batch_size: int, tokens_per_seq: int, context: int,
                     itemsize: int = 4, weight_itemsize: float | None = None, drafting: int | None = None,
                     kv_itemsize: float | None = None) -> Cost:
    """B sequences over ``context`` earlier tokens, each verifying T tokens (1 + k), or (``drafting``)
    the first ``drafting`` of them T tokens and the rest 1: logits on every row."""
    drafting = batch_size if drafting is None else min(drafting, batch_size)
    query_lens = [tokens_per_seq] * drafting + [1] * (batch_size - drafting)
    return step_cost(cfg, query_lens, [context + q for q in query_lens], logits_rows=sum(query_lens),
                     itemsize=itemsize, weight_itemsize=weight_itemsize, kv_itemsize=kv_itemsize)


def kv_entry_bytes(kv_cache: str) -> float | None:
    """Bytes of a KV entry for a fingerprint's ``kv_cache`` name when it is narrower than the
    activations (float16: 2); None: the activations' itemsize (float32, or a profile from before
    the float16 cache)."""
    return {"float16": 2.0, "bfloat16": 2.0}.get(kv_cache)


def grid_row_cost(cfg: ModelConfig, row, weight_itemsize: float | None = None, kv_itemsize: float | None = None) -> Cost:
    """``decode_step_cost`` of one row of a measured step grid (profiler/run.py ``measure_grid``):
    batch_size, tokens_per_seq, context and, where only some requests drafted, drafting (grids
    from before that column, and vLLM's, are all uniform)."""
    drafting = getattr(row, "drafting", None)
    return decode_step_cost(cfg, int(row.batch_size), int(row.tokens_per_seq), int(row.context),
                            weight_itemsize=weight_itemsize, kv_itemsize=kv_itemsize,
                            drafting=None if drafting is None or drafting != drafting else int(drafting))  # NaN: a row from a grid without it


def weight_bytes(cfg: ModelConfig, itemsize: int = 4, weight_itemsize: float | None = None) -> float:
    """Bytes of all weights read by one step (the memory floor's main term)."""
    w_item = itemsize if weight_itemsize is None else weight_itemsize
    h, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    products = h * (q_size + 2 * kv_size) + q_size * h + 3 * h * cfg.intermediate_size  # per layer
    floats = 2 * h + ((q_size + 2 * kv_size) if cfg.qkv_bias else 0)  # per layer: norms, biases
    return (float(products * cfg.num_layers + cfg.vocab_size * h) * w_item
            + float(floats * cfg.num_layers + h) * itemsize)
