"""The bench wing: everything that measures specplan against something else, and nothing the
planner loads. Offline policy evaluation (evaluate.py, clairvoyant.py), SLA sweeps against the
server (sweep.py and its report), engine benchmarks against transformers and llama.cpp
(engine_bench.py, spec_bench.py), the prompt sets (workloads.py) and the soak test (soak.py)."""
