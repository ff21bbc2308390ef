"""A task of the user's own: a data file with its own columns and no gold answer, prompted by their template and
scored by their reward, is loaded, sampled and scored the same way by `qae train` and `qae preview` (one step each on
the built-in model: the stored prompts are the template's, the stored rewards the function's)."""

from __future__ import annotations

import json

import pytest

from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.evaluation.task_preview import PreviewOptions, run_preview
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path
from qae_app.train.trainer import Trainer

REWARD = """
def ends_with_digit(completions, prompts, target, **columns):
    return [1.0 if c.strip()[-1:] == t else 0.0 for c, t in zip(completions, target)]
"""
RUN = dict(steps=1, prompts_per_step=2, group_size=4, eval_every=0, checkpoint_every=0, seed=2)


@pytest.fixture
def own_task(tmp_path):
    """(data file, reward spec): rows `{"id", "left", "right", "target"}`, no answer column at all."""
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"r{a}", "left": a, "right": a + 1, "target": str((2 * a + 1) % 10)}) + "\n"
            for a in range(8)
        )
    )
    reward = tmp_path / "digit.py"
    reward.write_text(REWARD)
    return data, f"{reward}:ends_with_digit"


def _check_rows(path) -> None:
    rows = query(
        path,
        "SELECT g.prompt, r.response, r.reward, c.value FROM rollouts r JOIN groups g "
        "USING (step, group_idx) JOIN reward_components c USING (step, group_idx, sample_idx)",
    )
    assert len(rows) == 8
    for prompt, response, reward, value in rows.itertuples(index=False):
        left, right = (int(x) for x in prompt.removesuffix("=").split("+"))
        want = 1.0 if response.strip()[-1:] == str((left + right) % 10) else 0.0
        assert reward == value == want, (prompt, response)


def test_train_and_preview_take_a_file_without_answers_with_their_template_and_reward(own_task, tmp_path):
    data, reward = own_task
    options = dict(data=str(data), reward=[reward], prompt_template="{left}+{right}=", **RUN)
    assert Trainer(build_config(run_name="own", **options), tmp_path, cpu=True).fit().status == "finished"
    _check_rows(db_path(tmp_path, "own"))
    run_id, path = run_preview(
        build_config(run_name="own-preview", **options), tmp_path, PreviewOptions(prompts=2), device="cpu"
    )
    _check_rows(path)


def test_a_built_in_reward_still_needs_the_answer_column(own_task, tmp_path):
    data, _ = own_task
    cfg = build_config(run_name="x", data=str(data), prompt_template="{left}+{right}=", **RUN)
    with pytest.raises(QAEUserError, match="has no answer"):
        Trainer(cfg, tmp_path, cpu=True)
