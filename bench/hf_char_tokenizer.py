"""The built-in character codec (`qae_app.models.policy.CharTokenizer`) as a transformers tokenizer, for bench/ only.

TRL's `GRPOTrainer` takes a `PreTrainedTokenizerBase`, not qae's small `TextCodec`, so bench/vs_trl.py hands it this
wrapper. Same ids as the codec: 0..3 are <pad>, <bos>, <eos>, <unk>, then one id per character; encoding a prompt
adds <bos> in front (as `CharTokenizer.encode` does) and nothing behind; decoding drops the special tokens. No chat
template, so TRL tokenizes plain-text prompts exactly as qae does.
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizer

from qae_app.models.policy import CharTokenizer


class HFCharTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "qae_char_vocab.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, chars: str = CharTokenizer.DEFAULT_CHARS, vocab_size: int = 64, **kwargs):
        self.codec = CharTokenizer(chars, vocab_size)
        pad, bos, eos, unk = CharTokenizer.SPECIALS
        # the vocabulary must exist before the base class registers the special tokens against it
        self._vocab = {token: i for i, token in enumerate(CharTokenizer.SPECIALS)}
        self._vocab.update({c: i for c, i in self.codec._to_id.items()})
        self._ids_to_tokens = {i: t for t, i in self._vocab.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("padding_side", "left")
        super().__init__(
            pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk, special_tokens_pattern="bos", **kwargs
        )

    @property
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return list(text)  # one token per character, spaces included

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self.codec.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._ids_to_tokens.get(index, CharTokenizer.SPECIALS[self.codec.unk_id])

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(t for t in tokens if t not in CharTokenizer.SPECIALS)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        path = os.path.join(
            save_directory, (filename_prefix + "-" if filename_prefix else "") + self.vocab_files_names["vocab_file"]
        )
        with open(path, "w") as f:
            json.dump({"chars": self.codec.chars, "vocab_size": self.codec.vocab_size}, f)
        return (path,)
