"""Hostile model outputs inside a real training step on a math task: each is scored within the deadline, a stuck
verifier is killed and replaced, the step goes on, and `frac_unverified` counts what could not be scored.

The policy here is the real built-in model, but its sampled text is replaced by `HostileEngine` (a stand-in: no
model can be made to emit these strings on demand). The response token ids stay short real ids so the loss's forward
pass is the real one; what the verifier sees is the hostile text."""

import threading

import pytest

from qae_app.config import build_config
from qae_app.engines.base import Sample
from qae_app.rewards.builtin_verifiers import BuiltinVerifier
from qae_app.store.reader import query, read_steps
from qae_app.store.run_folder import db_path
from qae_app.train.trainer import Trainer

POWER_TOWER = "\\boxed{9^{9^{9^{9}}}}"  # math-verify never returns on this
HOSTILE = [
    POWER_TOWER,
    "x" * 100_000 + " \\boxed{1}",
    "{" * 5000 + "\\boxed{1" + "}" * 5000,
    "so the answer is \\boxed{",
    "\\boxed{" + "7" * 10_000 + "}",
    "so the answer is \\boxed{1}",  # a correct one, scored 1 on prompt 0
]


class HostileEngine:
    def __init__(self, codec):
        self.codec = codec

    def sync_weights(self, model):
        pass

    def release_memory(self):
        pass

    def close(self):
        pass

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        samples = []
        for i, prompt in enumerate(prompts):
            ids = self.codec.encode(prompt)
            for j in range(n):
                text = HOSTILE[j % len(HOSTILE)]
                samples.append(Sample(i, ids, self.codec.encode_target(f"{j}")[:max_new_tokens], text, False))
        return samples


@pytest.fixture
def math_file(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"problem": "What is 0+1?", "answer": "1"}\n{"problem": "What is 3+4?", "answer": "7"}\n')
    return path


@pytest.mark.slow
def test_hostile_outputs_in_a_training_step(tmp_path, math_file):
    cfg = build_config(
        data=str(math_file),
        steps=2,
        group_size=len(HOSTILE),
        prompts_per_step=2,
        eval_every=0,
        max_new_tokens=4,
        verify_timeout_s=1.5,
        run_name="hostile",
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.engine = HostileEngine(trainer.codec)
    trainer.fit()
    steps = read_steps(db_path(tmp_path, "hostile"))
    assert steps["step"].tolist() == [1, 2]  # the run went on after the killed workers
    # 2 of 12 responses per step are power towers that time out; the rest are scored
    assert steps["frac_unverified"].tolist() == pytest.approx([2 / 12, 2 / 12])
    rollouts = query(
        db_path(tmp_path, "hostile"),
        "SELECT r.*, g.answer FROM rollouts r JOIN groups g "
        "USING (run_id, step, group_idx) WHERE step = 2 ORDER BY group_idx, sample_idx",
    )
    assert rollouts["verified"].tolist() == [False, True, True, True, True, True] * 2
    expected = {
        "1": [0, 1, 1, 0, 0, 1],  # long padding or deep braces around a final \boxed{1} are still right
        "7": [0, 0, 0, 0, 0, 0],
    }  # 10,000 sevens are not 7
    for answer, group in rollouts.groupby("answer"):
        assert group["reward"].tolist() == expected[answer]
    # the two stuck items of each step were cut at their deadline, side by side on the two workers
    pool = trainer.rewards.pool
    assert (pool.timeouts, pool.crashes, pool.batch_cutoffs, pool.peak_busy) == (2 * 2, 0, 0, 2)


def test_scoring_from_a_worker_thread_keeps_the_deadline():
    """math-verify's own timeout uses signal.alarm and refuses off the main thread; the pool does not care."""
    results = {}

    def score():
        with BuiltinVerifier("math", timeout_s=1.0) as verifier:
            results["rewards"] = verifier([POWER_TOWER, HOSTILE[-1]], ["1", "1"])
            results["timeouts"] = verifier.pool.timeouts

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=300)  # a hang detector, not a speed bound: without the deadline this never returns
    assert not thread.is_alive(), "scoring from a worker thread did not return: the deadline was not kept"
    assert results["rewards"] == [None, 1.0]
    assert results["timeouts"] == 1  # the tower was cut at its 1 s deadline off the main thread
