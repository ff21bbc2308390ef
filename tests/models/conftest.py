"""qae_app/models: loading a policy (a Hugging Face folder, a real tokenizer and its chat template, a GGUF file),
LoRA adapters, and when qae shards a model itself. The fixtures are tests/conftest.py's."""
