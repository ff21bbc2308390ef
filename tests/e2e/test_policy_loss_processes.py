"""Every policy loss under a real `accelerate launch --num_processes 2` (gloo on CPU), under DDP and under FSDP2
(configs/accelerate/fsdp2.yaml: qae shards with torch's fully_shard itself): the weights and step rows of the
one-process run on the same samples. Clip-Cov's draw, KL-Cov's top share and the entropy quantile are taken over the
whole mini-batch, not each process's share, and the adapted entropy coefficient is the same everywhere; these runs
show it (tests/scripts/same_samples.py samples each prompt from its own seed, so the samples do not depend on the
process count).

The plain clip loss is compared the same way in test_accelerate.py and test_fsdp2.py."""

import pytest
import torch

from qae_app.store.reader import read_steps
from qae_app.store.run_folder import db_path
from tests.e2e.test_accelerate import SCRIPT
from tests.e2e.test_accelerate import launch as launch_ddp
from tests.e2e.test_fsdp2 import launch as launch_with_config
from tests.same_steps import assert_same_metrics

# each loss with its selections picking many tokens (same_samples.LOSSES); the entropy controls ride on clip_cov
MODES = ["clip_cov+entropy", "kl_cov", "gspo", "cispo"]


@pytest.mark.slow
def test_two_processes_under_ddp_and_fsdp2_give_the_one_process_update(tmp_path):
    """One launch per process setup runs every mode in turn (the processes' imports are most of a launch's time)."""
    modes = ",".join(MODES)
    launches = {
        "one": launch_ddp(1, str(SCRIPT), str(tmp_path), "one", modes),
        "ddp": launch_ddp(2, str(SCRIPT), str(tmp_path), "ddp", modes),
        "fsdp2": launch_with_config("fsdp2", 2, str(SCRIPT), str(tmp_path), "fsdp2", modes),
    }
    for name, result in launches.items():
        assert result.returncode == 0, f"{name}: " + result.stdout[-3000:] + result.stderr[-3000:]
    for mode in MODES:
        named = mode.replace("+", ".")  # same_samples.py's run names: RUN_NAME-MODE, '.' for '+'
        one = torch.load(tmp_path / f"one-{named}.params.pt")
        steps = read_steps(db_path(tmp_path, f"one-{named}")).set_index("step")
        if mode.startswith(("clip_cov", "kl_cov")):
            assert (steps["cov_selected_frac"] > 0).all(), mode  # (the selection picked tokens: the test compares it)
        if "entropy" in mode:
            # 0.01, then + 0.005 after each of the 4 updates of a step (the entropy stays below the target 5)
            assert steps["entropy_coef"].tolist() == pytest.approx([0.03, 0.05, 0.07])
        for name in ("ddp", "fsdp2"):
            run = f"{name}-{named}"
            two = torch.load(tmp_path / f"{run}.params.pt")
            assert one.keys() == two.keys(), run
            for param in one:
                torch.testing.assert_close(one[param], two[param], atol=1e-6, rtol=0, msg=f"{run}: {param}")
            assert_same_metrics(steps, read_steps(db_path(tmp_path, run)).set_index("step"))
