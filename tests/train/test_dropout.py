"""RL runs without dropout: the old log-probs (no grad) and the update (train mode) must come from the same network,
so the first mini-batch's ratio is exactly 1 even on a checkpoint trained with dropout."""

import pytest
import torch

from qae_app.config import build_config
from qae_app.models.policy import load_policy
from qae_app.train import update
from qae_app.train.trainer import Trainer


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(config)


def _tiny_llama():
    from transformers import LlamaForCausalLM

    from qae_app.models.policy import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config()
    config.attention_dropout = 0.1  # Llama's only dropout: a float its attention reads, not an nn.Dropout
    return LlamaForCausalLM(config)


def _train_minus_eval_logprobs(model) -> float:
    ids = torch.randint(4, 64, (4, 24), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        torch.manual_seed(2)
        with torch.no_grad():
            outputs[mode] = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    return (outputs["train"] - outputs["eval"]).abs().max().item()


@pytest.mark.parametrize("build", [_tiny_gpt2, _tiny_llama], ids=["gpt2-nn.Dropout", "llama-attention_dropout"])
def test_disable_dropout_makes_train_mode_equal_eval_mode(build):
    from qae_app.models.policy import disable_dropout

    model = build()
    assert _train_minus_eval_logprobs(model) > 1e-2  # the checkpoint really has dropout
    disable_dropout(model)
    assert _train_minus_eval_logprobs(model) == 0.0
    fields = {name: value for name, value in vars(model.config).items() if "dropout" in name or "pdrop" in name}
    assert fields and set(fields.values()) == {0.0}, fields  # a saved checkpoint says what was trained


def test_every_ratio_is_one_while_the_policy_stands_still_on_a_checkpoint_with_dropout(tmp_path, monkeypatch):
    """With a negligible learning rate the policy does not move, so every mini-batch's ratio (new log-probs in train
    mode over old ones from the no-grad pass) must be 1; dropout in train mode alone would put it in ~[0.8, 1.3]."""
    model, codec = load_policy("builtin:tiny")
    model.config.attention_dropout = 0.1
    folder = tmp_path / "with_dropout"
    model.save_pretrained(folder)
    codec.save(folder)

    ratios = []
    real_policy_loss = update.policy_loss

    def recording_policy_loss(logp, old_logp, advantages, mask, *args, **kwargs):  # a spy: the real loss, unchanged
        ratios.append(torch.exp(logp - old_logp).detach()[mask.bool()])
        return real_policy_loss(logp, old_logp, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(update, "policy_loss", recording_policy_loss)
    cfg = build_config(
        model=str(folder),
        steps=1,
        prompts_per_step=4,
        group_size=8,
        num_mini_batches=4,
        lr=1e-12,
        eval_every=0,
        run_name="dropout",
        seed=3,
    )
    Trainer(cfg, tmp_path / "runs", cpu=True).fit()
    assert len(ratios) >= 2, "fewer than 2 mini-batches had a non-zero advantage: pick another seed"
    every = torch.cat(ratios)
    print(f"ratio range over {len(ratios)} mini-batches: {every.min().item():.8f} .. {every.max().item():.8f}")
    assert torch.allclose(every, torch.ones_like(every), atol=1e-5, rtol=0)
