"""HFTokenizerCodec on a real fast tokenizer with a chat template (built here with the `tokenizers` library, since
nothing can be downloaded; tests/e2e/test_real_model.py does the same with SmolLM2's own tokenizer): plain ids whatever
the transformers version returns, the template's special tokens exactly once, and the model's end-of-turn tokens as
stop ids."""

import pytest
import torch

from qae_app.models.policy import HFTokenizerCodec, load_policy

# (the `chat_folder` fixture, a small Llama with a ChatML template, is tests/conftest.py's: the training and evaluation
# tests use it too)


def test_chat_prompt_is_plain_ids_with_the_template_applied_once(chat_folder):
    model, codec = load_policy(str(chat_folder))
    assert isinstance(codec, HFTokenizerCodec) and codec.use_chat_template
    ids = codec.encode("What is 2 plus 3?")
    assert all(type(i) is int for i in ids)
    tokenizer = codec.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.startswith("<s><|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n")
    assert tokenizer.decode(ids) == rendered  # every template token, nothing added around it
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id  # BOS once, not twice
    tail = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(tail) :] == tail  # ends with the generation prompt: the model answers as the assistant
    # the same prompt goes through the model (this line raised "too many dimensions 'str'" before)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))


def test_without_template_the_tokenizer_adds_its_bos_once(chat_folder):
    _, codec = load_policy(str(chat_folder), use_chat_template=False)
    ids = codec.encode("What is 2 plus 3?")
    assert ids[0] == codec.tokenizer.bos_token_id and ids.count(codec.tokenizer.bos_token_id) == 1


def test_stop_ids_include_the_generation_configs_end_of_turn_tokens(chat_folder):
    _, codec = load_policy(str(chat_folder))
    ids = codec.tokenizer.convert_tokens_to_ids
    assert codec.eos_id == ids("<|endoftext|>")
    assert codec.stop_ids == [ids("<|endoftext|>"), ids("<|im_end|>")]  # tokenizer eos first, no duplicates


def test_plain_ids_from_every_return_type():
    from transformers import BatchEncoding

    from qae_app.models.policy import plain_ids

    expected = [5, 6, 7]
    for encoded in (
        [5, 6, 7],
        (5, 6, 7),
        [[5, 6, 7]],
        torch.tensor([5, 6, 7]),
        torch.tensor([[5, 6, 7]]),
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
        BatchEncoding({"input_ids": torch.tensor([[5, 6, 7]])}),
    ):
        assert plain_ids(encoded) == expected, encoded
    with pytest.raises(TypeError, match="expected token ids"):
        plain_ids(["<s>", "hi"])


# ---------------------------------------------------------------------------------------------------------------
# chat messages (a data row's `prompt` column, or --system-prompt): through the chat template as they are

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 plus 3?"}]


def test_chat_messages_go_through_the_template_as_they_are(chat_folder):
    _, codec = load_policy(str(chat_folder))
    ids = codec.encode(MESSAGES)
    assert codec.tokenizer.decode(ids) == (
        "<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
        "What is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids.count(codec.tokenizer.bos_token_id) == 1
    # a text prompt is one user message
    assert codec.encode("What is 2 plus 3?") == codec.encode(MESSAGES[1:])


def test_without_a_chat_template_messages_are_their_contents_joined_by_blank_lines(chat_folder):
    from qae_app.models.policy import CharTokenizer

    _, codec = load_policy(str(chat_folder), use_chat_template=False)
    assert codec.encode(MESSAGES) == codec.encode("You are terse.\n\nWhat is 2 plus 3?")
    char = CharTokenizer()
    assert char.encode([{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]) == char.encode(
        "be brief\n\n1+2="
    )


def test_a_template_that_refuses_the_messages_is_a_clear_error(chat_folder, tmp_path):
    """Gemma's template raises on a system message; the user hears which messages and what to do."""
    from qae_app.core.errors import QAEUserError

    _, codec = load_policy(str(chat_folder))
    codec.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(QAEUserError) as e:
        codec.encode(MESSAGES)
    assert str(e.value).startswith(
        "prompt: the model's chat template refuses the messages (system, user): System role not supported."
    )
    assert "--system-prompt" in str(e.value)


def test_prompt_lengths_of_chat_messages_are_bounded_then_measured(chat_folder):
    """A chat prompt's bound (its contents' bytes plus the template's scaffolding for messages of that shape, encoded
    once) is at least its encoded length, for every shape here; a prompt the bound cannot clear is encoded, so a long
    system message is caught with its exact length."""
    from qae_app.core.errors import QAEUserError
    from qae_app.models.policy import (
        check_prompt_lengths,
        most_prompt_tokens,
        prompts_longer_than,
        rollout_positions,
        template_tokens,
    )

    model, codec = load_policy(str(chat_folder))
    _, plain = load_policy(str(chat_folder), use_chat_template=False)
    prompts = [
        MESSAGES,
        MESSAGES[1:],
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": "é" * 40}],
        [
            {"role": "system", "content": "a\n\nb"},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 3 plus 4?", "name": "ann"},
        ],
    ]
    for tokenizer in (codec, plain):
        scaffolds = {}
        for prompt in prompts:
            assert len(tokenizer.encode(prompt)) <= most_prompt_tokens(
                tokenizer, prompt, template_tokens(tokenizer), scaffolds
            ), prompt
        assert len(scaffolds) == 3  # one per shape: the three prompts of one user message share theirs
    long = [{"role": "system", "content": "system " * 300}, {"role": "user", "content": "hi"}]
    n_tokens = len(codec.encode(long))
    assert prompts_longer_than(codec, [("a", long), ("b", "hi"), ("c", MESSAGES)], 100) == [("a", n_tokens)]
    assert rollout_positions(model, codec, [("a", long)], 8) == 256  # (capped at the model's context)
    with pytest.raises(QAEUserError, match=f"data: prompt 'a' is {n_tokens:,} tokens"):
        check_prompt_lengths(model, codec, [("a", long)], 8, "data")
