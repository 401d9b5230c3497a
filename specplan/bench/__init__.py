"""The bench wing: everything that measures specplan against something else, and nothing the
planner loads. Offline policy evaluation (evaluate.py, clairvoyant.py), SLA sweeps against the
server (sweep.py runs them from sla.py, arrivals.py, client.py, deciders.py and server_thread.py;
sweep_report.py renders them), engine benchmarks against transformers and llama.cpp
(engine_bench.py, spec_bench.py), the prompt sets (workloads.py) and the soak test (soak.py)."""
