"""Run at the start of every Python process that qae starts, or that a library in qae's process starts (vLLM inspects
a model class in a fresh `python -m vllm.model_executor.models.registry`), once qae hid torch extensions that cannot
load (core/torch_extensions.py): this folder is then first on the PYTHONPATH those processes inherit, and the names
in QAE_HIDDEN_EXTENSIONS are marked absent before anything imports transformers, as in qae's own process.

Python imports one `sitecustomize` module; the one this file shadows (a distribution's, a virtual environment's) is
run after it, so nothing else changes."""

import importlib.machinery
import importlib.util
import os
import sys

for _name in os.environ.get("QAE_HIDDEN_EXTENSIONS", "").split(","):
    if _name and _name not in sys.modules:
        sys.modules[_name] = None  # what importlib.util.find_spec reads as not installed

_here = os.path.dirname(os.path.abspath(__file__))
_shadowed = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [path for path in sys.path if os.path.abspath(path or ".") != _here]
)
if _shadowed is not None and _shadowed.loader is not None:
    _module = importlib.util.module_from_spec(_shadowed)
    sys.modules["sitecustomize"] = _module
    _shadowed.loader.exec_module(_module)
