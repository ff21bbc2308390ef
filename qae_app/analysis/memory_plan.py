"""`qae plan`: the per-GPU memory of a training run, by component, before anything runs. Pure arithmetic on the model's
shapes (its config.json, read without loading it or downloading anything) and the run's options; no torch.

    shape = model_shape("Qwen/Qwen3-8B-Base")              # from the HF cache, a folder, a .gguf file or shipped
    plan = plan_run(cfg, shape, Hardware(gpus=8, gpu_memory_gb=80, sharding="fsdp"))
    plan.total, plan.fits, plan.advice                      # bytes; whether it fits; the knobs to turn if not

What the plan counts, per GPU (one process), and in which phase of a step it is held (PHASES):
    weights           parameters x bytes of --dtype (FSDP: / processes, plus two gathered decoder layers and the
                      gathered root unit: embeddings, final norm and LM head, with their gradients before the
                      reduce-scatter)
    gradients         the trainable parameters' (LoRA: the adapters') x bytes of --dtype (FSDP: / processes; DDP
                      over several processes: twice, its all-reduce buckets are a copy)
    optimizer         AdamW's two moments, in the parameters' dtype as torch keeps them (FSDP: / processes)
    reference model   with --kl-beta > 0 and no LoRA: a full copy of the weights on every process
    activations       what autograd keeps of one micro-batch: per decoder layer and token, the saved tensors of a
                      Llama / Qwen3 layer (counted from the layer's own autograd graph: ACTIVATION_ELEMENTS); with
                      --gradient-checkpointing each layer's input only, plus one layer recomputed in the backward
    log-prob head     chunked (the default; under FSDP on the gathered head): three float32 chunks of logits and
                      the head's float32 gradient buffer; the full logits (LoRA's peft model, --logprob-chunk-tokens
                      0): six float32 (tokens, vocab) tensors (FULL_LOGITS_COPIES, from bench/bench_memory.py's
                      measurements)
    vLLM              --engine vllm: its gpu_memory_utilization share of the GPU (--vllm-gpu-memory, 0.35 by
                      default), which must hold vLLM's copy of the weights in --rollout-dtype (bfloat16 by default)
                      and leave room for its KV cache
    sampling copy     --engine hf with --rollout-dtype other than --dtype: the engine's own copy of every weight in
                      the rollout dtype (bfloat16 beside float32 weights: half the weights' bytes), held all run and
                      synced after each update

A mixture of experts (Qwen3MoE, Mixtral) counts every expert in what is stored (weights, gradients, optimizer
states, the gathered layers, vLLM's copy) and the experts_per_token experts a token goes through in what is computed
(activations; `ModelShape.active_parameters()` is what a token's compute scales with).

A step has two phases that do not overlap: the rollouts (vLLM generates; the trainer holds its weights, gradients and
optimizer state) and the update (the trainer's forward and backward passes). With --vllm-sleep (the default) vLLM's
memory is released through the update (vllm_engine: sleep mode) and taken back for the weight sync and the next
rollouts, so the peak is what both phases hold plus the larger of the two phases' own:

    peak = persistent + max(update phase, rollout phase)
    persistent    weights, gradients (kept from one update to the next), optimizer, DDP buckets, reference model,
                  the hf engine's sampling copy, and vLLM with --no-vllm-sleep
    update phase  gathered layers and root, bf16 weight copies, activations, log-prob head
    rollout phase vLLM with --vllm-sleep

(The weight sync between them holds vLLM's woken weights and one gathered unit at a time: less than either phase.)
It fits when the peak is within the GPU's memory less RESERVE_FRACTION (the CUDA context, the allocator's
fragmentation; an allowance, not a measurement). On a CPU the memory it predicts is the process's peak resident set
size minus its size before the model is built; `bench/bench_memory.py` measures that for the trainer's own update
(README, Memory: predicted within 20% at real architectures' widths).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import tomllib

from qae_app.config import PLAN_TABLE
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.models.packaged import PACKAGED_GGUF, packaged_gguf

GB = 1e9
RESERVE_FRACTION = 0.10  # of a GPU's memory, kept free for the CUDA context and the allocator's fragmentation
SHARDINGS = {
    "ddp": "every process holds all weights, gradients and optimizer state (DDP, ZeRO-0)",
    "fsdp": "weights, gradients and optimizer state split over the processes (FSDP2)",
}
PERSISTENT, UPDATE_PHASE, ROLLOUT_PHASE = "both", "update", "rollout"
# the phase of a step in which each component is held (see the module's docstring); vLLM's depends on --vllm-sleep
PHASES = {
    "weights": PERSISTENT,
    "gradients": PERSISTENT,
    "optimizer": PERSISTENT,
    "DDP buckets": PERSISTENT,
    "reference model": PERSISTENT,
    "sampling copy": PERSISTENT,
    "gathered layers": UPDATE_PHASE,
    "gathered root": UPDATE_PHASE,
    "bf16 weight copies": UPDATE_PHASE,
    "activations": UPDATE_PHASE,
    "log-prob head": UPDATE_PHASE,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SHIPPED_CONFIGS = Path(__file__).parents[1] / "assets" / "model_configs"  # config.json of models nothing can download
# float32 (tokens, vocab) tensors the full-logits path holds at its peak: the model's logits, logits / T, the
# log-softmax, its exp and their product in the no-grad pass with entropies (five), and what the allocator keeps;
# measured with bench/bench_memory.py: 5.4 (--logprob-chunk-tokens 0) and 6.3 (--lora-rank 16) copies
FULL_LOGITS_COPIES = 6
CHUNK_COPIES = 3  # float32 (chunk, vocab) tensors the chunked head holds at once


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on (a Llama / Qwen / Mistral config.json's fields)."""

    source: str  # where the shapes came from
    model_type: str  # config.json's model_type: llama, qwen3, ...
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    # a mixture of experts (Qwen3MoE, Mixtral): `moe_layers` of the layers route each token to `experts_per_token` of
    # their `experts` MLPs of width `expert_intermediate` through a linear router; the other layers are dense MLPs of
    # width `intermediate`. 0 experts: a dense model.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each head's queries and keys (q_norm, k_norm): more saved activations."""
        return self.model_type.startswith("qwen3")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each decoder layer's linear layers, by name: LoRA's targets (a dense layer's)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def _attention_and_norms(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return 2 * h * q + 2 * h * kv + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def dense_layer_parameters(self) -> int:
        return self._attention_and_norms() + 3 * self.hidden * self.intermediate

    def moe_layer_parameters(self, active: bool = False) -> int:
        """A mixture-of-experts layer: attention, norms, the router (hidden x experts) and every expert's gate, up and
        down projections; `active`: only the experts_per_token experts one token goes through."""
        experts = self.experts_per_token if active else self.experts
        return (
            self._attention_and_norms()
            + self.hidden * self.experts
            + experts * 3 * self.hidden * self.expert_intermediate
        )

    def layer_parameters(self) -> int:
        """The largest decoder layer's parameters (what FSDP gathers at once: every expert of a MoE layer)."""
        return max(
            self.moe_layer_parameters() if self.moe_layers else 0,
            self.dense_layer_parameters() if self.layers > self.moe_layers else 0,
        )

    def root_parameters(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def parameters(self) -> int:
        """Every parameter: what the weights, gradients, optimizer states and vLLM's copy hold."""
        return (
            self.root_parameters()
            + (self.layers - self.moe_layers) * self.dense_layer_parameters()
            + self.moe_layers * self.moe_layer_parameters()
        )

    def active_parameters(self) -> int:
        """The parameters one token goes through (a dense model: all of them): what its compute scales with."""
        return (
            self.root_parameters()
            + (self.layers - self.moe_layers) * self.dense_layer_parameters()
            + self.moe_layers * self.moe_layer_parameters(active=True)
        )

    def layer_activation_elements(self) -> int:
        """Elements autograd keeps per token for one decoder layer's backward (memory-efficient attention: nothing of
        size tokens x tokens). Counted on transformers' Llama and Qwen3 layers with saved_tensors_hooks, parameters
        left out: 6 x hidden (the two RMSNorms' inputs and outputs, the residual sums), 4 x intermediate (gate, up,
        SiLU(gate), their product), 2 x (q_dim + kv_dim) for the projections and rotary embedding (4 x with Qwen3's
        q_norm/k_norm), one float per head (the attention's log-sum-exp; two with Qwen3), 2 x head_dim (cos, sin).
        A mixture-of-experts layer's MLP part is `moe_mlp_activation_elements` instead (the larger of the two where a
        model has both kinds of layer)."""
        attention = (4 if self.qk_norm else 2) * (self.q_dim + self.kv_dim)
        per_head = (2 if self.qk_norm else 1) * self.heads
        mlp = 4 * self.intermediate if self.layers > self.moe_layers else 0
        if self.moe_layers:
            mlp = max(mlp, self.moe_mlp_activation_elements())
        return 6 * self.hidden + mlp + attention + per_head + 2 * self.head_dim

    def moe_mlp_activation_elements(self) -> int:
        """What a mixture-of-experts MLP keeps per token, counted on transformers' Qwen3MoE layer with
        saved_tensors_hooks: in each of the token's experts_per_token experts its input and output (2 x hidden), gate,
        up, SiLU(gate) and their product (4 x expert_intermediate) and 9 values of routing indices and weights; the
        router's softmax (one float per expert) and 4 more. The active experts' width, not every expert's."""
        per_expert = 2 * self.hidden + 4 * self.expert_intermediate + 9
        return self.experts_per_token * per_expert + self.experts + 4


# ---------------------------------------------------------------------------------------------------------------
# where the shapes come from


def shape_from_config(config: dict, source: str) -> ModelShape:
    """A ModelShape from a Hugging Face config.json's fields."""
    text = config.get("text_config") or config  # a multimodal model's language part
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        return ModelShape(
            source=source,
            model_type=str(text.get("model_type", "llama")),
            vocab=int(text["vocab_size"]),
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            tied_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            **_experts_of(text, source),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise QAEUserError(
            f"model: the config of {source} lacks {err} (needs vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers, num_attention_heads): qae plan reads decoder-only "
            "Llama-style configs."
        ) from None


def _experts_of(text: dict, source: str) -> dict:
    """The mixture-of-experts fields of a config: Qwen3MoE's num_experts, moe_intermediate_size, decoder_sparse_step
    and mlp_only_layers (which layers stay dense), Mixtral's num_local_experts (its experts are intermediate_size
    wide, in every layer); {} for a dense model."""
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if not experts:
        return {}
    shared = [key for key in text if key.startswith("shared_expert") or key.startswith("n_shared")]
    if shared:
        raise QAEUserError(
            f"model: the config of {source} has shared experts ('{shared[0]}'), which qae plan does not "
            "count: it sizes dense models and Qwen3MoE / Mixtral-style mixtures of routed experts."
        )
    step = int(text.get("decoder_sparse_step") or 1)
    dense = set(text.get("mlp_only_layers") or ())
    layers = int(text["num_hidden_layers"])
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return {
        "experts": experts,
        "experts_per_token": int(text["num_experts_per_tok"]),
        "moe_layers": moe_layers,
        "expert_intermediate": int(text.get("moe_intermediate_size") or text["intermediate_size"]),
    }


def _read_json(path: Path, source: str) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        reason = "nested deeper than any model config" if isinstance(err, RecursionError) else str(err)[:200]
        raise QAEUserError(f"model: cannot read {path} ({reason}). Pass a folder with a valid config.json.") from None
    if not isinstance(config, dict):
        raise QAEUserError(
            f"model: {path} holds a {type(config).__name__}, not a model config (a JSON object). Pass "
            "a folder with a valid config.json."
        )
    return config


def _gguf_shape(path: Path) -> ModelShape:
    """The shapes in a GGUF file's metadata (llama.cpp's keys: <arch>.embedding_length, ...)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as err:  # gguf raises ValueError('GGUF magic invalid') & co
        raise QAEUserError(
            f"model: {path} is not a GGUF file gguf can read ({str(err)[:200]}). Pass a .gguf model "
            "file (llama.cpp's format) or a Hugging Face model folder."
        ) from None

    def value(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise QAEUserError(f"model: {path} has no '{key}' in its metadata; qae plan cannot size it.")
            return default
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types and field.types[0].name == "STRING" else int(part[0])

    arch = value("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    hidden = value(f"{arch}.embedding_length")
    tensors = {t.name for t in reader.tensors}
    return ModelShape(
        source=f"{path} (GGUF metadata)",
        model_type=arch,
        vocab=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden=hidden,
        intermediate=value(f"{arch}.feed_forward_length"),
        layers=value(f"{arch}.block_count"),
        heads=heads,
        kv_heads=value(f"{arch}.attention.head_count_kv", heads),
        head_dim=value(f"{arch}.attention.key_length", hidden // heads),
        tied_embeddings="output.weight" not in tensors,
    )


def _hf_cache_config(repo_id: str) -> Path | None:
    """config.json of `repo_id` in the local Hugging Face cache, if it is there (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found) if isinstance(found, str) else None


def shipped_config(repo_id: str) -> Path:
    """Where qae ships a model's config.json (`org/name` -> assets/model_configs/org--name.json)."""
    return SHIPPED_CONFIGS / f"{repo_id.replace('/', '--')}.json"


def model_shape(spec: str) -> ModelShape:
    """The shapes of `--model` as `qae train` would load it: a built-in model, a local folder, a .gguf file, or a
    Hugging Face id found in the local cache or shipped in qae_app/assets/model_configs. Nothing is downloaded."""
    if spec == names.BUILTIN_SCRATCH or spec in BUILTIN_FOLDERS:
        folder = BUILTIN_FOLDERS.get(spec, BUILTIN_FOLDERS[names.BUILTIN_MODEL])
        return shape_from_config(_read_json(folder / "config.json", spec), f"{spec} ({folder / 'config.json'})")
    if spec in PACKAGED_GGUF:
        spec = str(packaged_gguf(spec))
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise QAEUserError(f"model: GGUF file '{spec}' does not exist. Pass the path of a local .gguf file.")
        return _gguf_shape(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QAEUserError(f"model: folder '{spec}' has no config.json. Pass a Hugging Face model folder.")
        return shape_from_config(_read_json(path / "config.json", spec), str(path / "config.json"))
    looks_like_id = not spec.startswith(("/", ".", "~", "builtin:")) and spec.count("/") <= 1 and "\\" not in spec
    if looks_like_id:
        for found in (_hf_cache_config(spec), shipped_config(spec)):
            if found is not None and found.is_file():
                where = (
                    f"shipped: qae_app/assets/model_configs/{found.name}" if found.parent == SHIPPED_CONFIGS else found
                )
                return shape_from_config(_read_json(found, spec), f"{spec} ({where})")
    raise QAEUserError(
        f"model: cannot find the shapes of '{spec}' on this machine (qae plan downloads nothing). "
        "Pass a local folder with config.json, a .gguf file, a built-in model, or a Hugging Face id "
        "whose config.json is in the local cache (e.g. after `huggingface-cli download ID "
        "config.json`)."
    )


BUILTIN_FOLDERS = {
    names.BUILTIN_MODEL: Path(__file__).parents[1] / "assets" / "tiny",
    "builtin:tiny-chain": Path(__file__).parents[1] / "assets" / "tiny-chain",
}


# ---------------------------------------------------------------------------------------------------------------
# the arithmetic


@dataclass(frozen=True)
class Hardware:
    """What a run is planned for."""

    gpus: int  # processes, one per GPU
    gpu_memory_gb: float  # each GPU's memory, in GB (1e9 bytes)
    sharding: str = "ddp"  # SHARDINGS
    prompt_tokens: int = 1024  # the longest prompt, in tokens (a micro-batch's sequences are prompt + response)

    def validate(self) -> Hardware:
        for name, value in (
            ("gpus", self.gpus),
            ("gpu-memory", self.gpu_memory_gb),
            ("prompt-tokens", self.prompt_tokens),
        ):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise QAEUserError(
                    f"{name}: {value} must be a positive number. Pass e.g. --gpus 8 --gpu-memory 80 "
                    "--prompt-tokens 2048."
                )
        if self.sharding not in SHARDINGS:
            raise QAEUserError(f"sharding: unknown value '{self.sharding}'. Choose one of: {', '.join(SHARDINGS)}.")
        return self


@dataclass(frozen=True)
class UpdateShape:
    """One micro-batch of the update and how it is computed: what the activations and the head depend on."""

    micro_tokens: int  # tokens through the model in one micro-batch (sequences x their longest)
    head_tokens: int  # positions through the vocabulary projection (from the earliest response token on)
    chunk_tokens: int  # the chunked head's tokens per chunk; 0: the full logits
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()  # () with lora_rank: every linear layer of the decoder
    weight_bytes: int = 4  # bytes per parameter (--dtype)
    activation_bytes: int = 4  # bytes per activation: bf16 autocast keeps bf16 activations
    autocast_weight_copy: bool = False  # bf16 autocast caches a bf16 copy of each weight for the step


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...] = ()) -> int:
    """A and B of every targeted linear layer: rank x (in + out) each."""
    if shape.is_moe:
        raise QAEUserError(
            f"lora-rank: qae plan does not size LoRA on a mixture of experts ({shape.source}: "
            f"{shape.experts} experts a layer, each with its own projections). Plan it with "
            "--lora-rank 0."
        )
    linears = shape.linear_shapes()
    chosen = targets or tuple(linears)
    unknown = [t for t in chosen if t not in linears]
    if unknown:
        raise QAEUserError(
            f"lora-targets: {shape.source} has no linear layer named '{unknown[0]}'. Its linear "
            f"layers: {', '.join(linears)}."
        )
    return shape.layers * sum(rank * sum(linears[t]) for t in chosen)


def update_components(
    shape: ModelShape, update: UpdateShape, processes: int = 1, sharding: str = "ddp", reference_model: bool = False
) -> list[tuple[str, float, str]]:
    """(component, bytes, what it is) of one process's memory during the update's backward, the peak."""
    return _parameter_rows(shape, update, processes, sharding, reference_model) + _activation_rows(shape, update)


def _parameter_rows(
    shape: ModelShape, update: UpdateShape, processes: int, sharding: str, reference_model: bool
) -> list[tuple[str, float, str]]:
    """The weights and what is kept per weight: FSDP's gathered layers, autocast copies, gradients, AdamW's moments,
    DDP's buckets and the reference model."""
    shard = processes if sharding == "fsdp" else 1
    wb = update.weight_bytes
    base = shape.parameters()
    adapters = lora_parameters(shape, update.lora_rank, update.lora_targets) if update.lora_rank else 0
    trainable = adapters if update.lora_rank else base
    sharded = f" / {shard} processes" if shard > 1 else ""
    rows = [
        (
            "weights",
            (base + adapters) * wb / shard,
            f"{(base + adapters) / 1e9:.3g}B parameters x {wb} bytes"
            + sharded
            + (f" ({adapters / 1e6:.3g}M of them LoRA adapters)" if adapters else ""),
        )
    ]
    if shard > 1:
        rows.append(
            (
                "gathered layers",
                2 * shape.layer_parameters() * wb,
                "FSDP: the decoder layer computed and the one prefetched, whole",
            )
        )
        root = shape.root_parameters()
        rows.append(
            ("gathered root", 2 * root * wb, "FSDP: embeddings, final norm, LM head whole, and their gradients")
        )
    if update.autocast_weight_copy:
        rows.append(("bf16 weight copies", (base + adapters) * 2 / shard, "autocast's bf16 copy of each weight"))
    what = "the LoRA adapters'" if update.lora_rank else "every parameter's"
    rows.append(("gradients", trainable * wb / shard, f"{what}, {wb} bytes each{sharded}"))
    rows.append(("optimizer", 2 * trainable * wb / shard, f"AdamW's two moments of {what}{sharded}"))
    if sharding == "ddp" and processes > 1:
        rows.append(("DDP buckets", trainable * wb, "DDP's all-reduce buckets: a second copy of the gradients"))
    if reference_model:
        rows.append(("reference model", base * wb, "--kl-beta: a frozen copy of the weights on every process"))
    return rows


def _activation_rows(shape: ModelShape, update: UpdateShape) -> list[tuple[str, float, str]]:
    """The activations a micro-batch's backward keeps, and the log-prob head's logits."""
    ab = update.activation_bytes
    rows = []
    tokens = update.micro_tokens
    layer = shape.layer_activation_elements() + (
        len(update.lora_targets or shape.linear_shapes()) * update.lora_rank if update.lora_rank else 0
    )
    model_level = 3 * shape.hidden  # the embeddings' output, the final norm's input and output
    if update.gradient_checkpointing:
        kept = shape.layers * shape.hidden + layer  # each layer's input, and one layer recomputed in the backward
        how = f"{shape.layers} layer inputs + 1 layer recomputed"
    else:
        kept = shape.layers * layer
        how = f"{shape.layers} layers x {layer:,} values a token"
    rows.append(
        ("activations", tokens * (kept + model_level) * ab, f"{tokens:,} tokens a micro-batch, {how}, {ab} bytes each")
    )
    if update.chunk_tokens:
        chunk = min(update.chunk_tokens, update.head_tokens)
        rows.append(
            (
                "log-prob head",
                (CHUNK_COPIES * chunk * shape.vocab + shape.vocab * shape.hidden) * 4,
                f"chunks of {chunk:,} tokens x {shape.vocab:,} vocab, and the head's float32 gradient",
            )
        )
    else:
        rows.append(
            (
                "log-prob head",
                FULL_LOGITS_COPIES * update.head_tokens * shape.vocab * 4,
                f"the full logits: {update.head_tokens:,} tokens x {shape.vocab:,} vocab, float32, "
                f"{FULL_LOGITS_COPIES} copies",
            )
        )
    return rows


def default_chunk_tokens(vocab: int) -> int:
    return names.default_chunk_tokens(vocab)


# ---------------------------------------------------------------------------------------------------------------
# a run's plan


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    hardware: Hardware
    components: list  # (component, bytes, phase: PERSISTENT / UPDATE_PHASE / ROLLOUT_PHASE, what it is)
    notes: list  # why the update runs as it does (the head's path, ...)
    advice: list  # (the knob, the peak it gives, whether that fits), when it does not fit

    def phase(self, phase: str) -> float:
        """Bytes of the components held in `phase` only (PERSISTENT: in both)."""
        return sum(size for _, size, held, _ in self.components if held == phase)

    @property
    def total(self) -> float:
        """The peak: what both phases hold, plus the larger phase's own."""
        return self.phase(PERSISTENT) + max(self.phase(UPDATE_PHASE), self.phase(ROLLOUT_PHASE))

    @property
    def budget(self) -> float:
        """Bytes a process may use: the GPU's memory less the reserve."""
        return self.hardware.gpu_memory_gb * GB * (1 - RESERVE_FRACTION)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


def _update_of(cfg, shape: ModelShape, hardware: Hardware) -> tuple[UpdateShape, list[str]]:
    """The UpdateShape a run of `cfg` computes on `hardware`, and why its head runs as it does."""
    sequence = hardware.prompt_tokens + cfg.max_new_tokens
    budget = cfg.max_tokens_per_micro_batch
    micro_tokens = budget if budget is not None else cfg.micro_batch_size * sequence
    notes = [
        f"a micro-batch: {micro_tokens:,} tokens ("
        + (
            f"--max-tokens-per-micro-batch {budget:,}"
            if budget is not None
            else f"--micro-batch-size {cfg.micro_batch_size} x (--prompt-tokens {hardware.prompt_tokens:,} + "
            f"--max-new-tokens {cfg.max_new_tokens:,})"
        )
        + ")"
    ]
    chunk = cfg.logprob_chunk_tokens if cfg.logprob_chunk_tokens is not None else default_chunk_tokens(shape.vocab)
    if chunk and cfg.lora_rank:
        chunk = 0
        notes.append("the log-probs come from the full logits: the chunked head does not run on a peft (LoRA) model")
    elif chunk and hardware.sharding == "fsdp" and hardware.gpus > 1:
        notes.append("the log-probs in chunks of tokens on the LM head's weight as FSDP2 gathers it for the forward")
    mixed = cfg.mixed_precision == "bf16"
    weight_bytes = DTYPE_BYTES[cfg.dtype]
    return UpdateShape(
        micro_tokens=micro_tokens,
        head_tokens=micro_tokens,
        chunk_tokens=chunk,
        gradient_checkpointing=cfg.gradient_checkpointing,
        lora_rank=cfg.lora_rank,
        lora_targets=tuple(t.strip() for t in (cfg.lora_targets or "").split(",") if t.strip()),
        weight_bytes=weight_bytes,
        activation_bytes=2 if mixed or weight_bytes == 2 else 4,
        autocast_weight_copy=mixed and weight_bytes == 4,
    ), notes


def _components(cfg, shape: ModelShape, hardware: Hardware) -> tuple[list, list]:
    if cfg.lora_rank and hardware.sharding == "fsdp" and hardware.gpus > 1:
        raise QAEUserError(
            "lora-rank: LoRA is not supported with sharded weights (FSDP). Plan it with --sharding ddp, "
            "or train every weight (--lora-rank 0)."
        )
    if cfg.prompts_per_step % hardware.gpus:
        raise QAEUserError(
            f"gpus: {hardware.gpus} processes cannot split --prompts-per-step {cfg.prompts_per_step}. "
            "Use a GPU count that divides it."
        )
    update, notes = _update_of(cfg, shape, hardware)
    rows = update_components(
        shape, update, hardware.gpus, hardware.sharding, reference_model=cfg.kl_beta > 0 and not cfg.lora_rank
    )
    phases = dict(PHASES)
    rollout_bytes = DTYPE_BYTES[cfg.rollout_dtype]  # the engine's weights: hf's copy, or vLLM's own
    if cfg.engine == "hf" and cfg.rollout_dtype != cfg.dtype:
        adapters = lora_parameters(shape, update.lora_rank, update.lora_targets) if update.lora_rank else 0
        rows.append(
            (
                "sampling copy",
                (shape.parameters() + adapters) * rollout_bytes,
                f"--rollout-dtype {cfg.rollout_dtype}: the engine's copy of the weights, {rollout_bytes} bytes "
                "each, synced after each update",
            )
        )
    if cfg.engine == "vllm":
        share = cfg.vllm_gpu_memory
        vllm_bytes, vllm_weights = share * hardware.gpu_memory_gb * GB, shape.parameters() * rollout_bytes
        if vllm_bytes <= vllm_weights:  # vLLM itself would refuse to start on the GPU
            raise QAEUserError(
                f"vllm-gpu-memory: {share:g} of each {hardware.gpu_memory_gb:g} GB GPU is "
                f"{vllm_bytes / GB:.1f} GB, no more than vLLM's {cfg.rollout_dtype} copy of the weights "
                f"({vllm_weights / GB:.1f} GB), so nothing is left for its KV cache and vLLM would not start. Use "
                f"--vllm-gpu-memory {math.ceil(vllm_weights / (hardware.gpu_memory_gb * GB) * 100) / 100:.2f} or more "
                "(the KV cache gets the rest of the share), or plan for GPUs with more memory."
            )
        asleep = cfg.vllm_sleep is not False  # (not given: on, as on every GPU build with sleep mode)
        held = "asleep in updates (--vllm-sleep)" if asleep else "held all run (--no-vllm-sleep)"
        rows.append(("vLLM", vllm_bytes, f"{share:g} of the GPU (--vllm-gpu-memory), {held}"))
        phases["vLLM"] = ROLLOUT_PHASE if asleep else PERSISTENT
    return [(name, size, phases[name], what) for name, size, what in rows], notes


def plan_run(cfg, shape: ModelShape, hardware: Hardware, advise: bool = True) -> Plan:
    """The per-GPU memory of a run of `cfg` (a TrainConfig) on `hardware`; when it does not fit, what each knob would
    make of it (each alone)."""
    hardware = hardware.validate()
    rows, notes = _components(cfg, shape, hardware)
    plan = Plan(shape, hardware, rows, notes, [])
    if plan.fits or not advise:
        return plan
    from dataclasses import replace

    sequence = hardware.prompt_tokens + cfg.max_new_tokens
    knobs = []
    if not cfg.gradient_checkpointing:
        knobs.append(("--gradient-checkpointing", replace(cfg, gradient_checkpointing=True), hardware))
    micro = plan_micro_tokens(cfg, hardware)
    if micro > sequence:
        knobs.append(
            (
                f"--max-tokens-per-micro-batch {sequence} (one longest sequence)",
                replace(cfg, max_tokens_per_micro_batch=sequence),
                hardware,
            )
        )
    if hardware.sharding == "ddp" and not cfg.lora_rank and hardware.gpus > 1:
        knobs.append(("--sharding fsdp", cfg, replace(hardware, sharding="fsdp")))
    if cfg.engine == "vllm" and cfg.vllm_sleep is False:
        knobs.append(("--vllm-sleep", replace(cfg, vllm_sleep=True), hardware))
    if not cfg.lora_rank and hardware.sharding == "ddp":
        knobs.append(("--lora-rank 16", replace(cfg, lora_rank=16), hardware))
    if hardware.sharding == "fsdp" and not cfg.lora_rank:
        for gpus in (2, 4, 8, 16, 32, 64, 128, 256):
            if gpus > hardware.gpus and cfg.prompts_per_step % gpus == 0:
                more = replace(hardware, gpus=gpus)
                if plan_run(cfg, shape, more, advise=False).fits:
                    knobs.append((f"--gpus {gpus}", cfg, more))
                    break
    for knob, other_cfg, other_hardware in knobs:
        other = plan_run(other_cfg, shape, other_hardware, advise=False)
        plan.advice.append((knob, other.total, other.fits))
    plan.advice.sort(key=lambda item: (not item[2], item[1]))
    return plan


def plan_micro_tokens(cfg, hardware: Hardware) -> int:
    return _update_of(cfg, ModelShape("", "llama", 1, 1, 1, 1, 1, 1, 1, True), hardware)[0].micro_tokens


def builtin_prompt_tokens(cfg) -> dict:
    """{"prompt_tokens": N} for a built-in model (one token a character, after <bos>): its task's longest prompt, as
    the run would build it; {} for any other model (whose tokenizer qae plan does not load)."""
    if cfg.model != names.BUILTIN_SCRATCH and cfg.model not in BUILTIN_FOLDERS:
        return {}
    from qae_app.data.prompt_format import prompt_text
    from qae_app.data.tasks import load_task

    task = load_task(cfg.data, prompt_format=cfg.prompt_format, require_answer=False)
    return {"prompt_tokens": 1 + max(len(prompt_text(task.prompt(p))) for p in task.train + task.heldout)}


def recipe_hardware(path: Path | None) -> dict:
    """The [plan] table of a run config file (the hardware it is planned for): gpus, gpu_memory_gb, sharding,
    prompt_tokens; {} without one."""
    if path is None:
        return {}
    try:
        table = tomllib.loads(Path(path).read_text()).get(PLAN_TABLE, {})
    except (OSError, ValueError):  # load_toml, run first, names what is wrong with the file
        return {}
    known = {"gpus": int, "gpu_memory_gb": (int, float), "sharding": str, "prompt_tokens": int}
    unknown = set(table) - set(known)
    if unknown:
        raise QAEUserError(
            f"config: unknown key '{sorted(unknown)[0]}' in the [{PLAN_TABLE}] table of {path}. Known: "
            f"{', '.join(sorted(known))}."
        )
    for key, value in table.items():  # (TOML's true is no count of GPUs: planned, it read "True x 80 GB")
        if isinstance(value, bool) or not isinstance(value, known[key]):
            wanted = {"sharding": "a name", "gpu_memory_gb": "a number"}.get(key, "a whole number")
            raise QAEUserError(
                f"config: [{PLAN_TABLE}] {key} = {clipped(repr(value))} in {path} is not {wanted}. "
                'Write e.g. gpus = 8, gpu_memory_gb = 80, sharding = "fsdp", prompt_tokens = 2048.'
            )
    return table


PHASE_LABELS = {PERSISTENT: "always", UPDATE_PHASE: "update", ROLLOUT_PHASE: "rollouts"}


def render(plan: Plan, console) -> None:
    """The plan as a rich table, the verdict, and the knobs when it does not fit."""
    from rich.table import Table

    hw = plan.hardware
    shape = plan.shape
    experts = (
        f" ({shape.active_parameters() / 1e9:.3g}B active a token: {shape.experts_per_token} of "
        f"{shape.experts} experts)"
        if shape.is_moe
        else ""
    )
    console.print(
        f"[bold]qae plan[/]: {shape.source}: {shape.parameters() / 1e9:.3g}B parameters{experts}, "
        f"{plan.shape.layers} layers, hidden {plan.shape.hidden:,}, vocab {plan.shape.vocab:,}; "
        f"{hw.gpus} x {hw.gpu_memory_gb:g} GB, {hw.sharding}",
        highlight=False,
    )
    table = Table(title="memory per GPU", title_justify="left")
    table.add_column("component")
    table.add_column("GB", justify="right")
    table.add_column("held")
    table.add_column("what")
    for name, size, phase, what in plan.components:
        table.add_row(name, f"{size / GB:.2f}", PHASE_LABELS[phase], what)
    persistent, update, rollout = (plan.phase(p) for p in (PERSISTENT, UPDATE_PHASE, ROLLOUT_PHASE))
    table.add_row(
        "[bold]peak[/]",
        f"[bold]{plan.total / GB:.2f}[/]",
        "",
        f"{persistent / GB:.2f} always + max(update {update / GB:.2f}, rollouts {rollout / GB:.2f})",
    )
    console.print(table)
    for note in plan.notes:
        console.print(f"  {note}", highlight=False)
    usable = f"{plan.budget / GB:.1f} GB usable ({hw.gpu_memory_gb:g} GB less {RESERVE_FRACTION:.0%} reserve)"
    if plan.fits:
        console.print(f"[green]fits[/]: {plan.total / GB:.1f} GB of {usable}", highlight=False)
        return
    console.print(f"[red]does not fit[/]: {plan.total / GB:.1f} GB of {usable}. Each knob alone:", highlight=False)
    for knob, total, fits in plan.advice:
        console.print(f"  {knob}: {total / GB:.1f} GB" + (" [green]fits[/]" if fits else ""), highlight=False)
    if not any(fits for _, _, fits in plan.advice):
        console.print("  none fits alone: combine them, or plan for GPUs with more memory", highlight=False)
