"""Policies: the built-in tiny model and its character tokenizer, and loading any Hugging Face causal LM.

Everything the trainer and the rollout engines need from a tokenizer is the small `TextCodec` interface, so the
built-in character tokenizer and a Hugging Face tokenizer are interchangeable.

The built-in model is a ~0.8M-parameter Llama (4 layers, hidden 128, vocab 64) built locally with transformers:
no download. `qae warmstart` trains it supervised on the arithmetic task's training split; the result ships in
`qae_app/assets/tiny/` so `qae train` starts RL at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from qae_app.errors import QAEUserError
from qae_app.names import BUILTIN_MODEL, BUILTIN_SCRATCH
ASSETS_DIR = Path(__file__).parent / "assets"
BUILTIN_CHECKPOINT = ASSETS_DIR / "tiny"
CHAR_TOKENIZER_FILE = "qae_char_tokenizer.json"


class TextCodec(Protocol):
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: Path) -> None: ...


class CharTokenizer:
    """One token per character. Ids 0..2 are <pad>, <bos>, <eos>; unknown characters map to <unk> (3)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    DEFAULT_CHARS = "0123456789+-*/=()., abcdefghijklmnopqrstuvwxyz?"

    def __init__(self, chars: str = DEFAULT_CHARS, vocab_size: int = 64):
        if len(self.SPECIALS) + len(chars) > vocab_size:
            raise ValueError(f"{len(chars)} characters do not fit a vocabulary of {vocab_size}")
        self.chars = chars
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(4)
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, text: str) -> list[int]:
        """The prompt's ids, starting with <bos>."""
        return [self.bos_id] + [self._to_id.get(c, self.unk_id) for c in text]

    def encode_target(self, text: str) -> list[int]:
        """A response's ids, ending with <eos> (for supervised warm start)."""
        return [self._to_id.get(c, self.unk_id) for c in text] + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._to_char.get(i, "") for i in ids if i not in (self.pad_id, self.bos_id, self.eos_id))

    def save(self, directory: Path) -> None:
        (Path(directory) / CHAR_TOKENIZER_FILE).write_text(
            json.dumps({"chars": self.chars, "vocab_size": self.vocab_size})
        )

    @classmethod
    def load(cls, directory: Path) -> "CharTokenizer":
        spec = json.loads((Path(directory) / CHAR_TOKENIZER_FILE).read_text())
        return cls(spec["chars"], spec["vocab_size"])


class HFTokenizerCodec:
    """A Hugging Face tokenizer behind the TextCodec interface; prompts use its chat template when it has one."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        if self.use_chat_template:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            ))
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(directory)


def tiny_llama_config(vocab_size: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_tiny_model(seed: int = 0):
    """The built-in architecture with fresh weights; deterministic for a given seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    return model, CharTokenizer()


def quiet_transformers() -> None:
    """No per-load progress bars or 'shared tensor' notices in our output: the CLI shows its own progress."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # accelerate notes on every checkpoint that the tied lm_head is stored once; that is expected, not news
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)


def load_policy(spec: str, dtype: str = "float32", use_chat_template: bool = True):
    """(model, codec) for `builtin:tiny`, `builtin:tiny-scratch`, a local folder or a Hugging Face id."""
    quiet_transformers()
    if spec == BUILTIN_SCRATCH:
        return build_tiny_model()
    if spec == BUILTIN_MODEL:
        if not (BUILTIN_CHECKPOINT / "config.json").exists():
            raise QAEUserError(
                f"model: the built-in checkpoint is missing from {BUILTIN_CHECKPOINT}. "
                "Rebuild it with `qae warmstart` (about 3 minutes on CPU)."
            )
        spec = str(BUILTIN_CHECKPOINT)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    path = Path(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
        if (path / CHAR_TOKENIZER_FILE).exists():
            codec = CharTokenizer.load(path)
        else:
            codec = HFTokenizerCodec(AutoTokenizer.from_pretrained(spec), use_chat_template)
    except (OSError, ValueError) as err:
        raise QAEUserError(
            f"model: cannot load '{spec}' ({type(err).__name__}: {str(err).splitlines()[0][:300]}). "
            f"Pass a local folder with config.json and weights, a Hugging Face id, or {BUILTIN_MODEL}."
        ) from err
    return model, codec


def model_context(model) -> int | None:
    """Positions the model was built for (max_position_embeddings, or GPT-2's n_positions); None if it does not say."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_prompt_lengths(model, codec: TextCodec, prompts: list[tuple[str, str]], max_new_tokens: int,
                         source: str) -> None:
    """QAEUserError, before anything runs, if a prompt (as encoded, chat template included) plus `max_new_tokens`
    does not fit the model's context: past it a model with learned positions crashes and a RoPE model degrades, and a
    megabyte prompt exhausts memory mid-run. `prompts` are (prompt id, prompt text); `source` names them ("data").

    Only prompts that might not fit are encoded: a token covers at least one UTF-8 byte, so a prompt whose bytes plus
    the template's own tokens fit is known to fit.
    """
    context = model_context(model)
    if context is None:
        return
    budget = context - max_new_tokens
    if budget < 1:
        raise QAEUserError(f"max-new-tokens: {max_new_tokens} leaves no room for a prompt in the model's context of "
                           f"{context:,} positions. Use --max-new-tokens below {context}.")
    template_tokens = len(codec.encode("")) + 1  # +1: a tokenizer may add a word-start token to the first word
    too_long = []
    for prompt_id, text in prompts:
        if len(text.encode("utf-8", "surrogatepass")) + template_tokens <= budget:
            continue
        n_tokens = len(codec.encode(text))
        if n_tokens > budget:
            too_long.append((prompt_id, n_tokens))
    if too_long:
        prompt_id, n_tokens = max(too_long, key=lambda item: item[1])
        more = f" ({len(too_long):,} prompts are too long; this is the longest)" if len(too_long) > 1 else ""
        raise QAEUserError(f"{source}: prompt '{prompt_id}' is {n_tokens:,} tokens, and with --max-new-tokens "
                           f"{max_new_tokens} it needs {n_tokens + max_new_tokens:,} positions, but the model's "
                           f"context is {context:,}{more}. Remove or shorten those problems, lower --max-new-tokens, "
                           "or use a model with a longer context.")
