"""LoRA (--lora-rank): only the adapters train, the KL's reference is the base model without a second copy, the
engines sample from / are given the adapted model, checkpoints hold the merged model and the adapter, a resume is
exact. Real tiny model, real peft, real checkpoints."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.lora import (
    ADAPTER_DIR,
    MODEL_DIR,
    AdaptersDisabled,
    apply_lora,
    linear_module_names,
    merged_state_dict,
    resolve_targets,
)
from qae_app.models.policy import build_tiny_model, load_policy
from qae_app.models.sharding import ShardingPlan
from qae_app.store.reader import query, read_steps
from qae_app.store.run_folder import db_path, latest_checkpoint
from qae_app.train.session import resume_config
from qae_app.train.trainer import Trainer
from qae_app.train.update import UpdateOptions, logprobs_in_chunks, pack
from tests.conftest import TINY_RUN_OPTIONS
from tests.launching import ONE_MACHINE
from tests.same_steps import assert_same_metrics

runner = CliRunner()

LORA = dict(TINY_RUN_OPTIONS, eval_every=0, lora_rank=4)
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_tiny_model(rank: int = 4, seed: int = 0):
    """The built-in architecture with adapters whose B is not 0 (fresh adapters leave the model unchanged)."""
    model, codec = build_tiny_model()
    model = apply_lora(model, rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model, codec


def base_weights(model) -> dict[str, torch.Tensor]:
    """A LoRA model's frozen weights, cloned."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# the adapters and what they merge into


def test_default_targets_are_every_linear_layer_but_the_output_layer():
    model, _ = build_tiny_model()
    assert linear_module_names(model) == LLAMA_LINEARS
    assert resolve_targets(model, None) == LLAMA_LINEARS
    assert resolve_targets(model, "q_proj, v_proj") == ["q_proj", "v_proj"]


def test_merged_weights_are_base_plus_b_at_a_times_alpha_over_rank():
    model, _ = adapted_tiny_model(rank=4)
    merged = merged_state_dict(model)
    plain, _ = build_tiny_model()  # the same base weights (seeded), no adapters
    assert list(merged) == list(plain.state_dict())  # the Hugging Face checkpoint's names, in its order
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
    by_hand = plain.model.layers[1].mlp.down_proj.weight + B @ A * (8 / 4)  # default alpha: 2 x rank
    torch.testing.assert_close(merged["model.layers.1.mlp.down_proj.weight"], by_hand, rtol=0, atol=1e-7)
    assert torch.equal(merged["model.embed_tokens.weight"], plain.model.embed_tokens.weight)  # not adapted
    # and it is peft's own merge, bit for bit, without changing the training model
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.equal(merged[name], reference[name]) for name in reference)
    assert "lora_A" in str(model)


def test_hf_engine_samples_from_the_adapted_model():
    model, codec = adapted_tiny_model()
    engine = HFGenerateEngine(model, codec)
    plain, _ = build_tiny_model()
    ids = torch.tensor([codec.encode("12+7=")])
    with torch.no_grad():
        adapted, base = engine.model(ids).logits, plain(ids).logits
        assert torch.equal(adapted, model(ids).logits) and not torch.allclose(adapted, base)
    engine.sync_weights(model)  # what the trainer passes after each update: the (unwrapped) peft model
    samples = engine.generate(["12+7="], n=3, temperature=1.0, max_new_tokens=4, seed=0)
    assert len(samples) == 3 and all(s.token_logprobs is not None for s in samples)


def test_the_kl_reference_gives_the_base_models_log_probs():
    model, codec = adapted_tiny_model()
    plain, _ = build_tiny_model()
    samples = HFGenerateEngine(model, codec).generate(["3+4=", "9*2="], n=2, temperature=1.0, max_new_tokens=4, seed=1)
    batch = pack(samples, codec.pad_id, "cpu")
    options = UpdateOptions(
        num_mini_batches=1,
        ppo_epochs=1,
        micro_batch_size=64,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token",
        kl_beta=0.1,
        max_grad_norm=1.0,
        max_new_tokens=4,
        temperature=1.0,
    )
    rows = torch.arange(len(samples))
    reference = logprobs_in_chunks(AdaptersDisabled(model), batch, rows, options)[0]
    assert torch.equal(reference, logprobs_in_chunks(plain, batch, rows, options)[0])
    assert not torch.allclose(reference, logprobs_in_chunks(model, batch, rows, options)[0])  # the adapters act


# ---------------------------------------------------------------------------------------------------------------
# training


def test_only_the_adapters_train_and_the_reference_is_no_second_model(tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr("qae_app.train.trainer.load_policy", lambda *a, **k: loads.append(a) or load_policy(*a, **k))
    cfg = build_config(run_name="lora", **dict(LORA, steps=2, kl_beta=0.1, num_mini_batches=1))
    trainer = Trainer(cfg, tmp_path, cpu=True)
    assert len(loads) == 1  # the policy only: the reference is the policy with its adapters off
    assert isinstance(trainer.ref_model, AdaptersDisabled) and trainer.ref_model.module is trainer.model
    adapters = {id(p) for name, p in trainer.model.named_parameters() if "lora_" in name}
    in_optimizer = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in in_optimizer} == adapters and len(in_optimizer) == len(adapters) == 4 * 7 * 2
    frozen = base_weights(trainer.model)
    adapters_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainer.fit().status == "finished"
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if n in frozen)
    moved = [
        n
        for n, p in trainer.model.named_parameters()
        if n in adapters_before and not torch.equal(p, adapters_before[n])
    ]
    assert any("lora_B" in n for n in moved)
    steps = read_steps(db_path(tmp_path, "lora"))
    # step 1's one update starts at the base model (B = 0 adds exactly 0); step 2's policy has left it
    assert steps["kl"].iloc[0] == 0.0 < steps["kl"].iloc[1]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_checkpoint_holds_the_merged_model_and_the_adapter_and_eval_loads_it(tmp_path):
    cfg = build_config(run_name="lora", **dict(LORA, steps=2))
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.fit()
    checkpoint = latest_checkpoint(tmp_path / "lora")
    merged, _ = load_policy(str(checkpoint / MODEL_DIR))  # a plain model folder, as `qae eval` loads it
    want = merged_state_dict(trainer.model)
    got = merged.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    from peft import PeftModel

    base, _ = load_policy(cfg.model)
    adapter = PeftModel.from_pretrained(base, str(checkpoint / ADAPTER_DIR))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(adapter(ids).logits, trainer.model(ids).logits)
    result = runner.invoke(
        app, ["eval", "--model", "lora", "--limit", "4", "--samples", "2", "--runs-dir", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)


def test_resume_is_exact_with_lora(tmp_path):
    """4 steps equal 2 steps, a resume from their checkpoint, and 2 more: every metric, every response, the
    adapter."""
    opts = dict(LORA, steps=4, checkpoint_every=2, kl_beta=0.05)
    full = Trainer(build_config(run_name="full", **opts), tmp_path, cpu=True)
    full.fit()
    Trainer(build_config(run_name="cut", **dict(opts, steps=2)), tmp_path, cpu=True).fit()
    resumed = Trainer(resume_config(tmp_path, "cut", steps=4), tmp_path, resume=True, cpu=True)
    assert resumed.state.step == 2
    resumed.fit()
    want, got = (read_steps(db_path(tmp_path, run)).set_index("step") for run in ("full", "cut"))
    assert got.index.tolist() == [1, 2, 3, 4]
    assert_same_metrics(want, got)
    sql = "SELECT step, group_idx, sample_idx, response, advantage FROM rollouts ORDER BY step, group_idx, sample_idx"
    assert query(db_path(tmp_path, "full"), sql).equals(query(db_path(tmp_path, "cut"), sql))
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_train_command_takes_the_lora_options(tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "--lora-rank",
            "2",
            "--lora-alpha",
            "3",
            "--lora-targets",
            "q_proj,v_proj",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--run-name",
            "cli",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    adapter = json.loads((latest_checkpoint(tmp_path / "cli") / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (2, 3, ["q_proj", "v_proj"])


# ---------------------------------------------------------------------------------------------------------------
# bad values: refused before the run starts, naming the option and the fix


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lora_rank=-1), "lora-rank: -1 is less than 0"),
        (dict(lora_rank=4, lora_alpha=0.0), "lora-alpha: 0.0 must be more than 0"),
        (dict(lora_rank=4, lora_alpha=float("nan")), "lora-alpha: nan is not a finite number"),
        (dict(lora_rank=4, lora_dropout=0.05), "lora-dropout: 0.05 is more than 0.0.*same network"),
        (dict(lora_alpha=16.0), "lora-alpha: 16.0 does nothing without LoRA. Set --lora-rank"),
        (dict(lora_targets="q_proj"), "lora-targets: q_proj does nothing without LoRA"),
        (dict(lora_rank=4, lora_targets=" , "), "lora-targets: ' , ' names no layer"),
    ],
)
def test_bad_lora_options_are_refused(options, message):
    with pytest.raises(QAEUserError, match=message):
        build_config(**options)


@pytest.mark.parametrize(
    "targets, message",
    [
        (
            "q_proj,qkv",
            "lora-targets: builtin:tiny has no linear layer named 'qkv'. Its linear layers: "
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        ),
        ("lm_head", "lora-targets: 'lm_head' is the output layer"),
    ],
)
def test_a_target_the_model_lacks_is_refused_with_the_layers_it_has(tmp_path, targets, message):
    with pytest.raises(QAEUserError, match=message):
        Trainer(build_config(run_name="bad", lora_rank=4, lora_targets=targets), tmp_path, cpu=True)
    assert not (tmp_path / "bad").exists()


def test_lora_with_sharded_weights_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "qae_app.train.trainer.sharding_plan_for", lambda accelerator: ShardingPlan("fsdp2", True, True)
    )
    with pytest.raises(QAEUserError, match=r"lora-rank: LoRA is not supported with sharded weights \(fsdp2\)"):
        Trainer(build_config(run_name="sharded", lora_rank=4), tmp_path, cpu=True)


# ---------------------------------------------------------------------------------------------------------------
# a real pretrained model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_lora_on_smollm2_trains_only_adapters_and_eval_loads_the_checkpoint(smollm2_gguf, tmp_path):
    """SmolLM2-135M (GGUF), 2 steps with --lora-rank 8. Overlong shaping gives the groups signal whatever the
    answers (a shorter response earns more), so the adapters move."""
    cfg = build_config(
        run_name="smol",
        model=str(smollm2_gguf),
        data="arith",
        lora_rank=8,
        steps=2,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=16,
        overlong_buffer=12,
        num_mini_batches=1,
        lr=1e-3,
        eval_every=0,
        seed=3,
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    assert trainer.model.peft_config["default"].target_modules == set(LLAMA_LINEARS)  # the default targets
    frozen = base_weights(trainer.model)
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in trainer.model.named_parameters() if n in adapters
    }
    assert trainer.fit().status == "finished"
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in frozen.items())
    assert any(not torch.equal(params[n], w) for n, w in adapters.items() if "lora_B" in n)
    result = runner.invoke(
        app,
        [
            "eval",
            "--model",
            "smol",
            "--bench",
            "arith",
            "--limit",
            "2",
            "--samples",
            "1",
            "--max-new-tokens",
            "8",
            "--runs-dir",
            str(tmp_path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_two_processes_train_the_one_process_adapters(tmp_path):
    """Under `accelerate launch --num_processes 2` (DDP over gloo) the adapters, the KL to the adapters-off reference
    and every stored row are those of one process on the same samples (tests/scripts/same_samples.py)."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    script = Path(__file__).parents[1] / "scripts" / "same_samples.py"
    for n in (1, 2):
        command = [
            accelerate,
            "launch",
            "--num_processes",
            str(n),
            *ONE_MACHINE,
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            *(["--multi_gpu"] if n > 1 else ["--cpu"]),
            str(script),
            str(tmp_path),
            f"p{n}",
            "lora",
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (torch.load(tmp_path / f"p{n}.params.pt") for n in (1, 2))
    assert one.keys() == two.keys() and any("lora_B" in name for name in one)
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-6, rtol=0, msg=name)
    steps1, steps2 = (read_steps(db_path(tmp_path, f"p{n}")).set_index("step") for n in (1, 2))
    assert (steps1["kl"] > 0).any()
    assert_same_metrics(steps1, steps2)
