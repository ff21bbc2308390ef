"""LoRA's bounds are checked before any work: a rank above the narrowest adapted layer's width (the allocator's
RuntimeError for 1.4 GB before) and an alpha whose alpha / rank scale overflows (three steps written, then
`probability tensor contains either inf, nan or element < 0`) are one message, exit 2, nothing written."""

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--lora-rank", "1000000"],
            "lora-rank: 1000000 is more than the narrowest adapted layer of builtin:tiny is "
            "wide (model.layers.0.self_attn.q_proj: 128). Use a rank of at most 128",
        ),
        (["--lora-rank", "129"], "Use a rank of at most 128"),
        (
            ["--lora-rank", "4", "--lora-alpha", "1e308"],
            "lora-alpha: 1e+308 scales the adapters' output by alpha / rank = 2.5e+307",
        ),
        (["--lora-rank", "4", "--lora-alpha", "401"], "Use an alpha of at most 100 x --lora-rank (400)"),
    ],
)
def test_a_lora_bound_is_one_message_before_any_work(tmp_path, args, message):
    runs = tmp_path / "runs"
    result = CliRunner().invoke(
        app, ["train", *args, "--steps", "1", "--cpu", "--runs-dir", str(runs)], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not runs.exists() or not any(runs.rglob("*"))


def test_the_largest_rank_and_scale_allowed_still_train(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--lora-rank",
            "128",
            "--lora-alpha",
            "12800",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--cpu",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
