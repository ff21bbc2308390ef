"""qae_app/engines: the rollout engines (HF generate and its own decode loop, vLLM's glue), sampling and the
sharded policies. The fixtures are tests/conftest.py's."""
