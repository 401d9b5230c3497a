"""specplan inside other serving engines. Each module here imports its engine and is imported only
by that engine (vLLM loads ``specplan.integrations.vllm.SpecplanProposer`` by name); importing
specplan never imports them."""
