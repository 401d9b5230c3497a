"""Attention time of one B=32 decode step (context 256, 30 layers) holding one 5-node draft tree:
the CPU kernel (which reads trees) vs the torch reference (which every tree step took before).
A development benchmark: run from the repo root, `python scripts/bench_tree_attention.py`; it
reuses the batch builders of tests/test_attention_cpu.py."""
import random
import statistics
import sys
import time

import torch
sys.path.insert(0, "tests")
from test_attention_cpu import tree_batch, make_tensors, random_tree, reference
from specplan.engine.model.attention import AttentionPlan, paged_attention
from specplan.engine.model.attention_cpu import paged_attention_cpu
rng = random.Random(0)
specs = [(256, 1)] * 31 + [(256, 5)]
trees = {31: random_tree(rng, 5)}
batch, nb = tree_batch(specs, trees, 16, 0)
q, k, v = make_tensors(batch, nb, 16, 9, 3, 64, torch.float32, 0)
def kern():
    for _ in range(30): paged_attention_cpu(q, k, v, batch, 0.125, None)
def ref():
    plan = AttentionPlan.build(batch, 16, 3, None)
    for _ in range(30): paged_attention(q, k, v, plan, 0.125)
with torch.inference_mode():
    for f in (kern, ref): f()
    res = {"kernel": [], "reference": []}
    for _ in range(7):
        for name, f in (("kernel", kern), ("reference", ref)):
            t = time.perf_counter(); f(); res[name].append(time.perf_counter() - t)
for n, v in res.items(): print(n, round(statistics.median(v) * 1e3, 1), "ms per 30 layers")
