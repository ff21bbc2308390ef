"""LoRA adapters (peft) on the policy: `--lora-rank R` trains only low-rank adapters on the model's linear layers.

    model = apply_lora(model, rank, alpha, targets)   # a peft model: the base weights frozen, adapters trainable
    AdaptersDisabled(model)                           # the KL's reference: the base model, no second copy
    merged_weights(model)                             # (name, W + B @ A * alpha / rank): what vLLM and `qae eval` load
    save_lora_artifacts(checkpoint, model)            # checkpoint/model: the merged HF folder; checkpoint/adapter
    load_lora_adapter(checkpoint, model)              # the adapter back into the training model (resume)

Only the adapters get gradients and optimizer state (the memory it saves: AdamW's two moments and the gradient of
every base weight). Dropout stays off (`lora_dropout=0`): the old log-probs and the update must see the same network
(see policy.disable_dropout).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from qae_app.core.errors import QAEUserError

ADAPTER_DIR = "adapter"  # a checkpoint's adapter (peft's save_pretrained): exact resume, or use with peft directly
MODEL_DIR = "model"  # a checkpoint's full Hugging Face folder (with LoRA: the merged weights)
ADAPTER_NAME = "default"  # peft's name of the one adapter qae trains


def is_lora(model: torch.nn.Module) -> bool:
    """`model` (unwrapped) is a peft model with LoRA adapters. (A run without LoRA never imports peft: no peft
    model can exist before it is imported.)"""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def output_layer_names(model: torch.nn.Module) -> set[str]:
    """Leaf names of the model's output layer (lm_head): never a LoRA target (tied to the input embeddings in many
    models, and the vocabulary projection is the largest layer)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head and name}


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The leaf names of the model's nn.Linear layers, output layer excluded, in model order: the LoRA targets it
    has (a Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""
    head = output_layer_names(model)
    names = (name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    return [name for name in dict.fromkeys(names) if name not in head]


def parse_targets(text: str | None) -> list[str]:
    """`--lora-targets q_proj,v_proj` -> ['q_proj', 'v_proj']; None or '' -> []."""
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def resolve_targets(model: torch.nn.Module, text: str | None, model_name: str = "the model") -> list[str]:
    """The LoRA targets of `--lora-targets` on this model (default: every linear layer but the output layer); a
    QAEUserError naming the linear layers it has when one is missing."""
    available = linear_module_names(model)
    wanted = parse_targets(text) or available
    head = output_layer_names(model)
    for name in wanted:
        if name in head:
            raise QAEUserError(
                f"lora-targets: '{name}' is the output layer of {model_name}; qae does not put an "
                "adapter on it (it is tied to the input embeddings in many models). Use some of: "
                f"{', '.join(available)}."
            )
        if name not in available:
            raise QAEUserError(
                f"lora-targets: {model_name} has no linear layer named '{name}'. Its linear layers: "
                f"{', '.join(available)}. Pass a comma list of those, or leave --lora-targets out "
                "for all of them."
            )
    if not wanted:
        raise QAEUserError(
            f"lora-rank: {model_name} has no linear layers besides its output layer to put adapters "
            "on. Train it without LoRA (--lora-rank 0)."
        )
    return wanted


def check_rank_fits(model: torch.nn.Module, rank: int, targets: list[str], model_name: str) -> None:
    """Refuse, before any adapter is allocated, a rank above the narrowest adapted layer's width: past it an adapter
    is no longer low-rank (it adds parameters, not capacity), and a huge one asks the allocator for gigabytes."""
    widths = {
        name: min(module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    narrowest = min(widths, key=widths.get)
    if rank > widths[narrowest]:
        raise QAEUserError(
            f"lora-rank: {rank} is more than the narrowest adapted layer of {model_name} is wide "
            f"({narrowest}: {widths[narrowest]}). Use a rank of at most {widths[narrowest]} (8-64 "
            "is usual)."
        )


def lora_alpha(rank: int, alpha: float | None) -> float:
    """--lora-alpha, default 2 x rank: the adapter's output is scaled by alpha / rank = 2 whatever the rank."""
    return float(alpha) if alpha is not None else 2.0 * rank


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float | None = None,
    targets: str | None = None,
    model_name: str = "the model",
) -> torch.nn.Module:
    """`model` with LoRA adapters of `rank` on `targets` (a comma list; default: every linear layer but the output
    layer): a peft model whose base weights are frozen. B starts at 0, so the adapted model starts as the base model;
    A's initialisation draws from torch's global generator (seeded by the trainer)."""
    from peft import LoraConfig, get_peft_model

    target_modules = resolve_targets(model, targets, model_name)
    check_rank_fits(model, rank, target_modules, model_name)
    config = LoraConfig(
        r=rank,
        lora_alpha=lora_alpha(rank, alpha),
        lora_dropout=0.0,
        bias="none",
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft reads a property transformers 5 deprecated: nothing a user can act on
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every parameter of a full fine-tune, only the adapters of a LoRA model."""
    return [p for p in model.parameters() if p.requires_grad]


class AdaptersDisabled(torch.nn.Module):
    """The base model of a LoRA policy, as a module of its own: each forward runs the policy with its adapters off
    (peft's disable_adapter), so the KL's reference policy costs no second copy of the weights. `.module` is the
    wrapped policy, as a DDP wrapper names it."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        if not is_lora(policy):
            raise TypeError(f"AdaptersDisabled needs a peft model, got {type(policy).__name__}")
        self.module = policy

    def forward(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.module(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# merged weights: what vLLM and `qae eval` load, computed without touching the training model


def _lora_layers(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the adapted model's weights as a plain model of the base's class names them (the Hugging
    Face checkpoint's names): W + B @ A * alpha / rank for each adapted layer, the base weight as is for the rest.
    One merged tensor at a time (vLLM's weight sync loads them as they come); the training model is not changed.
    The sum is peft's own merge (get_delta_weight, added in the weight's dtype), so it equals merge_and_unload's."""
    base = model.get_base_model()
    layers = _lora_layers(base)
    with torch.no_grad():
        for key, tensor in base.state_dict(keep_vars=True).items():
            owner, _, leaf = key.rpartition(".")
            if ".lora_" in f".{key}":  # lora_A / lora_B / lora_magnitude_vector ...: folded into their layer
                continue
            if owner.endswith(".base_layer") or owner == "base_layer":
                layer_name = owner[: -len(".base_layer")] if owner != "base_layer" else ""
                layer = layers.get(layer_name)
                name = f"{layer_name}.{leaf}" if layer_name else leaf
                if layer is not None and leaf == "weight" and ADAPTER_NAME in layer.lora_A:
                    yield name, tensor.detach() + layer.get_delta_weight(ADAPTER_NAME)
                else:
                    yield name, tensor.detach()
            else:
                yield key, tensor.detach()


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(merged_weights(model))


def save_lora_artifacts(folder: Path, model: torch.nn.Module) -> None:
    """A LoRA checkpoint's two model folders: `model/`, the merged weights as a full Hugging Face model folder (so
    `qae eval --model RUN` and vLLM load it as any model), and `adapter/`, the adapter alone (peft's
    save_pretrained). `model` unwrapped; the training model is not changed."""
    folder = Path(folder)
    model.save_pretrained(folder / ADAPTER_DIR)
    base = model.get_base_model()
    merged = merged_state_dict(model)
    # tied weights (an lm_head tied to the embeddings) share one tensor, so the save stores it once, as for the base
    base.save_pretrained(folder / MODEL_DIR, state_dict=merged, safe_serialization=True)


def load_lora_adapter(folder: Path, model: torch.nn.Module) -> None:
    """The adapter saved in checkpoint `folder` back into `model` (unwrapped), for an exact resume; nothing when the
    model has no adapters or the checkpoint no adapter/ folder."""
    path = Path(folder) / ADAPTER_DIR
    if not is_lora(model) or not path.is_dir():
        return
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    result = set_peft_model_state_dict(model, load_peft_weights(str(path), device="cpu"), adapter_name=ADAPTER_NAME)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise QAEUserError(
            f"resume: checkpoint {folder} holds adapter weights this model lacks "
            f"({', '.join(unexpected[:3])}): it was trained with other --lora-targets. Start a new "
            "run."
        )
