"""HFTokenizerCodec on a real fast tokenizer with a chat template (built here with the `tokenizers` library, since
nothing can be downloaded; tests/e2e/test_real_model.py does the same with SmolLM2's own tokenizer): plain ids whatever
the transformers version returns, the template's special tokens exactly once, and the model's end-of-turn tokens as
stop ids."""

import pytest
import torch

from qae_app.models.policy import HFTokenizerCodec, load_policy

# a ChatML template (Qwen, SmolLM2) that also writes the BOS token itself, as Llama-3's and Gemma's do
CHATML_WITH_BOS = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                   "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
SPECIALS = ["<pad>", "<unk>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A Hugging Face folder: a small Llama, a BPE tokenizer that adds BOS, a ChatML template, and a
    generation_config whose eos is a list (<|im_end|>, <|endoftext|>) as Qwen2.5-Instruct's is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("chat_model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 2 plus 3? Please reason step by step.", "The answer is \\boxed{5}.", "user assistant system"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHATML_WITH_BOS
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config)
    ids = fast.convert_tokens_to_ids
    model.generation_config = GenerationConfig(bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id,
                                               eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")])
    model.save_pretrained(folder)
    return folder


def test_chat_prompt_is_plain_ids_with_the_template_applied_once(chat_folder):
    model, codec = load_policy(str(chat_folder))
    assert isinstance(codec, HFTokenizerCodec) and codec.use_chat_template
    ids = codec.encode("What is 2 plus 3?")
    assert all(type(i) is int for i in ids)
    tokenizer = codec.tokenizer
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}],
                                             add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<s><|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n")
    assert tokenizer.decode(ids) == rendered  # every template token, nothing added around it
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id  # BOS once, not twice
    tail = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(tail):] == tail  # ends with the generation prompt: the model answers as the assistant
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
    for encoded in ([5, 6, 7], (5, 6, 7), [[5, 6, 7]], torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]]),
                    {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
                    BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
                    BatchEncoding({"input_ids": torch.tensor([[5, 6, 7]])})):
        assert plain_ids(encoded) == expected, encoded
    with pytest.raises(TypeError, match="expected token ids"):
        plain_ids(["<s>", "hi"])
