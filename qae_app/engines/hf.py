"""The transformers engine: `generate` (or, for Llama-family models, qae's own decode loop in engines/decode.py) on
the training model itself, so there are no weights to sync; or, with a `rollout_dtype` other than the model's (what
vLLM's bf16 kernels are to a float32 trainer, on any machine), on a copy of it in that dtype, synced after each
update."""

from __future__ import annotations

import copy
import inspect
import itertools

import torch

from qae_app.core.errors import QAEUserError
from qae_app.data.prompt_format import Prompt
from qae_app.engines import decode
from qae_app.engines.base import Sample, cut_at_stop
from qae_app.engines.sampling import PLAIN_SAMPLING, SamplingOptions
from qae_app.engines.sharded_policy import ShardedPolicy
from qae_app.models.policy import TextCodec, templated_prompt


class SamplingStats:
    """The temperature of plain sampling as a logits processor (generate then runs at temperature 1 with no other
    processor, so what this returns is exactly what is sampled from, whatever order a transformers version puts
    processors in), recording on the way the log-prob of each sampled token and the entropy at each position, per
    row, without keeping any step's logits beyond the next one (a step's sampled token is known only at the next
    call, or from the output after the last)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._previous: torch.Tensor | None = None  # (rows, vocab) log-probs of the last step
        self.logprobs: list[torch.Tensor] = []  # per step: (rows,)
        self.entropies: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._previous is not None:
            self.logprobs.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = scores / self.temperature  # (rows, vocab), as transformers' TemperatureLogitsWarper does
        logp = torch.log_softmax(scores.float(), dim=-1)
        self.entropies.append(-(logp.exp() * logp).nan_to_num(0.0).sum(-1))  # 0 * -inf: a token never sampled
        self._previous = logp
        return scores

    def finish(self, last_tokens: torch.Tensor) -> tuple[list[list[float]], list[list[float]]]:
        """(log-probs, entropies) per row and generated position, given the tokens of the last step."""
        if self._previous is None:
            return [], []
        self.logprobs.append(self._previous.gather(-1, last_tokens[:, None]).squeeze(-1))
        return torch.stack(self.logprobs, 1).tolist(), torch.stack(self.entropies, 1).tolist()


def sampling_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model `generate` runs on: `model` itself, or for a LoRA (peft) model its base model, whose
    linear layers peft replaced by adapted ones (so it samples from the adapted policy) and whose generation_config
    is the one sample_batch sets aside (a peft wrapper would take the assignment on itself)."""
    from qae_app.models.lora import is_lora

    return model.get_base_model() if is_lora(model) else model


class HFGenerateEngine:
    """transformers `generate` on the training model itself (no copy, so there are no weights to sync), or on a copy
    in `rollout_dtype` when that is not the model's dtype."""

    def __init__(
        self,
        model: torch.nn.Module,
        codec: TextCodec,
        batch_size: int = 256,
        sampling: SamplingOptions = PLAIN_SAMPLING,
        sharded: ShardedPolicy | None = None,
        rollout_dtype: torch.dtype | None = None,
    ):
        self.codec = codec
        self.batch_size = batch_size  # sequences per generate call
        self.sampling = sampling.validate()
        self.sharded = sharded or ShardedPolicy()
        self.model = sampling_model(model)
        self.copied = rollout_dtype is not None and rollout_dtype != next(self.model.parameters()).dtype
        if self.copied:
            if self.sharded.plan.sharding != "none":
                raise QAEUserError(
                    f"rollout-dtype: a sampling copy in {str(rollout_dtype).removeprefix('torch.')} "
                    f"needs the full weights on each process, and these are sharded "
                    f"({self.sharded.plan.sharding}). Leave --rollout-dtype at --dtype, or launch "
                    "with DDP."
                )
            # its own weights, never trained: no gradients, and what sync_weights copies the trained ones into
            self.model = copy.deepcopy(self.model).to(rollout_dtype).requires_grad_(False)
        self.share_prompts = True  # compute a prompt's cache once for its group (bench/bench_generate.py compares)
        # sample with qae_app.engines.decode's loop instead of model.generate where the model allows it (same tokens)
        self.use_decode_loop = True

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample from `model`'s weights from now on: the model itself, or its weights copied (cast) into the copy."""
        if not self.copied:
            self.model = sampling_model(model)
            return
        copies = dict(self.model.named_parameters())
        for name, parameter in sampling_model(model).named_parameters():
            copies[name].copy_(parameter)  # (cast to the copy's dtype)

    def release_memory(self) -> None:
        """Nothing to free: this engine samples from the trained model itself."""

    def close(self) -> None:
        """Nothing to shut down: the engine runs in the trainer's own forward passes."""

    def generation_config(self, temperature: float, max_new_tokens: int):
        """Every setting that shapes the sampled distribution or the stopping, spelled out: exactly
        softmax(logits / T) (truncated only by this engine's SamplingOptions), stopping at any of the codec's stop
        ids after at most max_new_tokens."""
        from transformers import GenerationConfig

        s = self.sampling
        return GenerationConfig(
            do_sample=True,
            num_beams=1,
            num_return_sequences=1,
            temperature=temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p if s.min_p > 0 else None,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0,
            min_new_tokens=0,
            max_new_tokens=max_new_tokens,
            renormalize_logits=False,
            remove_invalid_values=False,
            eos_token_id=list(self.codec.stop_ids),
            pad_token_id=self.codec.pad_id,
            use_cache=True,
        )

    def sample_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config, repeats: list[int] | None = None, **extra
    ):
        """One `generate` call that sees only `config`: the model's own generation_config is set aside meanwhile,
        because transformers fills every setting left unset (and, in some versions, every one left at its library
        default) from it.

        `repeats`: the rows are consecutive copies of fewer prompts (a group's G samples), `repeats[k]` rows of the
        k-th: the prompts' tokens but the last go through the model once per prompt instead of once per row, and
        their cache is copied to each row (what vLLM's prefix caching does); the tokens sampled are the same."""
        model = self.model
        saved = model.generation_config
        model.generation_config = config
        try:
            with self.sharded.generation_context():
                if repeats is not None and input_ids.shape[1] > 1:
                    extra = {**extra, **self._shared_prefix(input_ids, attention_mask, repeats)}
                return model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=config,
                    synced_gpus=self.sharded.plan.synced_generate,
                    **extra,
                )
        finally:
            model.generation_config = saved

    def _shared_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, repeats: list[int]) -> dict:
        """generate()'s keyword for a cache holding every row's prompt but its last token, computed once per
        distinct prompt. Positions follow the left padding as generate numbers them."""
        from transformers import DynamicCache

        model = self.model
        firsts = torch.tensor([0, *itertools.accumulate(repeats)][:-1], device=input_ids.device)
        prompt_ids, prompt_mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]  # (k, width - 1)
        positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # transformers before 4.56 builds its layers as they come
            cache = DynamicCache()
        keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True, **{keyword: cache}
        )
        cache.batch_select_indices(
            torch.repeat_interleave(
                torch.arange(len(repeats), device=input_ids.device), torch.tensor(repeats, device=input_ids.device)
            )
        )
        return {keyword: cache}

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[Sample]:
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        torch.manual_seed(seed)
        # from plain softmax(logits / T) sampling, the per-token stats the trainer reports come along for free: the
        # SamplingStats processor applies the temperature itself, so generate runs at temperature 1
        plain = self.sampling == PLAIN_SAMPLING
        config = self.generation_config(1.0 if plain else temperature, max_new_tokens)
        encoded = [self.codec.encode(p) for p in prompts]
        shown = [templated_prompt(self.codec, ids) for ids in encoded]
        # every prompt repeated n times, in order: sample j of prompt i sits at i * n + j
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]
        samples: list[Sample] = []
        loop = (
            plain
            and self.use_decode_loop
            and max_new_tokens > 0
            and self.sharded.plan.sharding == "none"
            and decode.supports_decode_loop(model)
        )
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            if loop:  # the same samples as generate's below, sooner (qae_app/engines/decode.py)
                samples += self._decode_loop_chunk(chunk, temperature, max_new_tokens, shown)
            else:
                samples += self._generate_chunk(chunk, n, config, temperature, plain, shown, device)
        model.train(was_training)
        return samples

    def _decode_loop_chunk(
        self, chunk: list[tuple[int, list[int]]], temperature: float, max_new_tokens: int, shown: list[str]
    ) -> list[Sample]:
        """`chunk`'s (prompt index, prompt ids) sampled by the project's own decode loop."""
        rows = decode.sample(self.model, [ids for _, ids in chunk], temperature, max_new_tokens, self.codec.stop_ids)
        samples = []
        for (i, ids), (generated, logprobs, entropies) in zip(chunk, rows, strict=True):
            response, truncated = cut_at_stop(generated, self.codec.stop_ids)
            samples.append(
                Sample(i, ids, response, self.codec.decode(response), truncated, logprobs, entropies, shown[i])
            )
        return samples

    def _generate_chunk(
        self,
        chunk: list[tuple[int, list[int]]],
        n: int,
        config,
        temperature: float,
        plain: bool,
        shown: list[str],
        device,
    ) -> list[Sample]:
        """`chunk`'s (prompt index, prompt ids) sampled by transformers' generate, left-padded to one width; under
        plain sampling with each token's log-prob and entropy."""
        width = max(len(ids) for _, ids in chunk)
        # left padding, built as lists and converted once: a tensor write per row costs more than the rest of
        # the engine's bookkeeping together (bench/bench_generate.py)
        input_ids = torch.tensor([[self.codec.pad_id] * (width - len(ids)) + ids for _, ids in chunk])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk])
        from transformers import LogitsProcessorList

        stats = SamplingStats(temperature) if plain else None
        # a group's samples share their prompt: its cache is computed once (not under synced generation, where
        # every process must run the same forwards)
        repeats = (
            [len(list(rows)) for _, rows in itertools.groupby(i for i, _ in chunk)]
            if n > 1 and self.share_prompts and not self.sharded.plan.synced_generate
            else None
        )
        if stats is not None:
            out = self.sample_batch(
                input_ids.to(device),
                attention_mask.to(device),
                config,
                repeats,
                logits_processor=LogitsProcessorList([stats]),
            )
        else:
            out = self.sample_batch(input_ids.to(device), attention_mask.to(device), config, repeats)
        token_logprobs, token_entropies = (
            stats.finish(out[:, -1]) if stats is not None and out.shape[1] > width else (None, None)
        )
        new_tokens = out[:, width:].tolist()
        samples = []
        for row, ((i, ids), generated) in enumerate(zip(chunk, new_tokens, strict=True)):
            response, truncated = cut_at_stop(generated, self.codec.stop_ids)
            length = len(response)
            samples.append(
                Sample(
                    i,
                    ids,
                    response,
                    self.codec.decode(response),
                    truncated,
                    token_logprobs[row][:length] if token_logprobs is not None else None,
                    token_entropies[row][:length] if token_entropies is not None else None,
                    shown[i],
                )
            )
        return samples
