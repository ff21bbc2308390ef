"""A task built to be hacked, in TRL's reward signature, for the tests of which reward carries the signal: on the
built-in arithmetic task, `exact_with_unit` wants the answer followed by " apples", which the built-in model's
character vocabulary cannot even spell (it has no 'l' after 'app'... nor any reason to), so it never fires; the format
reward `one_char` pays 1 for a reply of one character, which the model gives to some prompts and not others.

    qae train --reward tests/hacking_rewards.py:exact_with_unit --reward tests/hacking_rewards.py:one_char \\
        --reward-weights 1,0.2
"""


def exact_with_unit(completions, answer, **kwargs):
    return [
        1.0 if completion.strip() == f"{gold} apples!" else 0.0
        for completion, gold in zip(completions, answer, strict=True)
    ]


def one_char(completions, **kwargs):
    return [1.0 if len(completion.strip()) == 1 else 0.0 for completion in completions]


def anything(completions, **kwargs):
    """Full marks for any reply: every group all correct (reward saturation)."""
    return [1.0 for _ in completions]


def longer(completions, **kwargs):
    """Pays for length up to 8 characters: at a high learning rate the built-in model's replies grow until
    --max-new-tokens 8 cuts them (length runaway, a truncation jump)."""
    return [min(len(completion), 8) / 8 for completion in completions]
