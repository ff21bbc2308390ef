"""Evaluation: sample k responses per problem, score them, and report avg@k, pass@k and maj@k.

- avg@k: mean accuracy over all k samples of all problems (the paper's avg@32).
- pass@k': unbiased estimator of Chen et al. 2021 from the k samples, for k' in 1, 2, 4, ... <= k (and k).
- maj@k: the majority answer among the k extracted answers is correct (ties: the answer seen first wins).

Each is reported for the whole benchmark (subset "all") and, where problems carry them, per subject and level.
"""

from __future__ import annotations

import json
import shlex
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from qae_app.config import EvalConfig
from qae_app.core.errors import QAEUserError
from qae_app.core.host_faults import check_path_names, environment_errno, environment_error
from qae_app.data.datasets import Problem
from qae_app.data.prompt_format import Prompt
from qae_app.engines.base import RolloutEngine
from qae_app.engines.sampling import SamplingOptions
from qae_app.evaluation.metrics import avg_at_k, maj_at_k, pass_at_k, pass_k_values
from qae_app.rewards.builtin_verifiers import BuiltinVerifier
from qae_app.rewards.registry import RewardSet, data_columns
from qae_app.scoring.reward_path import reward_prompt, run_benchmark
from qae_app.store.reader import results_only_kind
from qae_app.store.run_folder import (
    CHECKPOINTS_DIR,
    MANIFEST,
    RUN_NAME_PATTERN,
    check_own_folder,
    checkpoint_problem,
    checkpoint_step,
    db_path,
    eval_run_error,
    list_checkpoints,
    model_folder_problem,
    read_run_config,
    read_run_file,
    recent_runs_text,
    validate_run_name,
)
from qae_app.store.writer import RunWriter


@dataclass
class EvalResult:
    benchmark: str
    k: int
    samples: list[dict]  # one per (problem, sample): problem_id, sample_idx, response, extracted, correct, ...
    metrics: list[dict]  # benchmark, subset, metric, k, value, n_problems


def sample_and_score(
    engine: RolloutEngine,
    problems: list[Problem],
    prompts: list[Prompt],
    rewards: RewardSet | BuiltinVerifier,
    k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    on_batch=None,
    batch_problems: int = 64,
) -> list[dict]:
    """k samples for each problem, scored by the rewards (a RewardSet; a built-in's BuiltinVerifier is taken as one):
    `correct` is full marks (registry.RewardSet.correct). `on_batch(n_done)` is called after each batch."""
    rewards = rewards if isinstance(rewards, RewardSet) else RewardSet.of_verifier(rewards)
    rows: list[dict] = []
    for start in range(0, len(problems), batch_problems):
        chunk = problems[start : start + batch_problems]
        samples = engine.generate(
            prompts[start : start + batch_problems], k, temperature, max_new_tokens, seed=seed + start
        )
        texts = [s.text for s in samples]
        _, components = rewards.score(
            texts,
            [reward_prompt(prompts[start + s.prompt_index], chunk[s.prompt_index]) for s in samples],
            [chunk[s.prompt_index] for s in samples],
            0,
            [s.response_ids for s in samples],
        )
        counters = defaultdict(int)
        for sample, text, correct, verified in zip(
            samples, texts, rewards.correct(components), rewards.verified(components), strict=True
        ):
            problem = chunk[sample.prompt_index]
            rows.append(
                {
                    "problem_id": problem.prompt_id,
                    "sample_idx": counters[sample.prompt_index],
                    "response": text,
                    "extracted": rewards.extract(text),  # what the reward read: maj@k's vote
                    # the gold answer it was checked against
                    "answer": None if problem.answer is None else str(problem.answer),
                    "correct": correct,
                    "verified": verified,
                    "n_tokens": len(sample.response_ids),
                    "model_prompt": sample.model_prompt,  # chat template applied; None without one
                }
            )
            counters[sample.prompt_index] += 1
        if on_batch is not None:
            on_batch(len(chunk))
    return rows


def summarize(benchmark: str, problems: list[Problem], samples: list[dict], k: int) -> list[dict]:
    """Metric rows for the whole benchmark and for each subject / level present in the problems' meta."""
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for row in samples:
        by_problem[row["problem_id"]].append(row)
    subsets: dict[str, list[Problem]] = {"all": problems}
    for key in ("subject", "level"):
        for p in problems:
            if key in p.meta and p.meta[key] is not None:
                subsets.setdefault(f"{key}={p.meta[key]}", []).append(p)
    metrics = []
    for subset, members in subsets.items():
        groups = [by_problem[p.prompt_id] for p in members if by_problem[p.prompt_id]]
        if not groups:
            continue
        n = len(groups)

        def add(metric: str, kk: int, value: float, subset: str = subset, n: int = n) -> None:
            metrics.append(
                {"benchmark": benchmark, "subset": subset, "metric": metric, "k": kk, "value": value, "n_problems": n}
            )

        add("avg@k", k, sum(avg_at_k([r["correct"] for r in g]) for g in groups) / n)
        for kk in pass_k_values(k):
            add("pass@k", kk, sum(pass_at_k(len(g), sum(r["correct"] for r in g), kk) for g in groups) / n)
        add("maj@k", k, sum(maj_at_k([r["extracted"] for r in g], [r["correct"] for r in g]) for g in groups) / n)
    return metrics


def evaluate(
    engine: RolloutEngine,
    benchmark: str,
    problems: list[Problem],
    prompts: list[Prompt],
    rewards: RewardSet | BuiltinVerifier,
    k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    on_batch=None,
) -> EvalResult:
    samples = sample_and_score(engine, problems, prompts, rewards, k, temperature, max_new_tokens, seed, on_batch)
    return EvalResult(benchmark, k, samples, summarize(benchmark, problems, samples, k))


# ---------------------------------------------------------------------------------------------------------------
# `qae eval`: resolve what to evaluate, run it, store it

DEFAULT_MAX_NEW_TOKENS = {"exact_int": 8, "chain_final": 48, "math": 1024}


@dataclass
class EvalTarget:
    model_path: str  # what load_policy / the engine loads
    run_id: str | None  # the training run it belongs to (results go into that run's database)
    step: int  # the checkpoint's step (0 for a model that is not a run checkpoint)
    skipped: tuple[str, ...] = ()  # newer checkpoints of the run passed over, and why


def resolve_model(spec: str, runs_dir, checkpoint: int | None = None, exporting: bool = False) -> EvalTarget:
    """A run id (its newest or --checkpoint N), builtin:tiny, a local folder or a Hugging Face id. `exporting`: for
    `qae export`, whose errors name its own argument and what it can do instead (it takes no model folder)."""
    folder = Path(runs_dir) / spec
    # a run folder: checkpoints, or a database only (a run killed before its first checkpoint)
    if RUN_NAME_PATTERN.match(spec) and ((folder / CHECKPOINTS_DIR).is_dir() or db_path(runs_dir, spec).exists()):
        if kind := results_only_kind(folder):
            raise eval_run_error(
                "model",
                folder,
                f"Pass the model it {'evaluated' if kind == 'eval' else 'sampled'} "
                f"(`qae show {spec}` names it), a training run's id or a model "
                "folder.",
                kind,
            )
        check_own_folder(folder / CHECKPOINTS_DIR)  # (a linked one holds no checkpoint of this run's)
        found = list_checkpoints(folder)
        if checkpoint is None:
            if not found:
                raise QAEUserError(
                    f"{'run' if exporting else 'model'}: run '{spec}' has no checkpoint yet. Wait for "
                    "--checkpoint-every steps."
                )
            return _newest_sound_checkpoint(spec, found, exporting)
        ckpt = next((c for c in found if checkpoint_step(c) == checkpoint), None)
        if ckpt is None:
            have = ", ".join(c.name for c in found) or "none"
            raise QAEUserError(f"checkpoint: run '{spec}' has no checkpoint {checkpoint} (has: {have}).")
        problem = _model_problem(ckpt)
        if problem is not None:
            raise QAEUserError(
                f"checkpoint: {ckpt} does not check out ({problem}). "
                f"{'Export' if exporting else 'Evaluate'} another one with --checkpoint N, or drop "
                "--checkpoint for the newest that checks out."
            )
        return EvalTarget(str(ckpt / "model"), spec, checkpoint_step(ckpt))
    if checkpoint is not None:
        raise QAEUserError(f"checkpoint: --checkpoint needs --model to be a run id in {runs_dir}; '{spec}' is not.")
    if _looks_like_a_run_id(spec):
        raise QAEUserError(
            f"model: there is no run '{spec}' in {runs_dir}, and it is no built-in model, local folder "
            f"or file (runs there, last written first: {recent_runs_text(Path(runs_dir))}). Pass a run "
            "id (`qae runs`), a model folder, a .gguf file, or a Hugging Face id as org/name."
        )
    return EvalTarget(spec, None, 0)


def _model_problem(ckpt: Path) -> str | None:
    """Why a checkpoint's model cannot be loaded as it was saved (a file altered, cut, linked or planted), or None: its
    files match their checksums, and each reads as what it is (a manifest rewritten to match passes the first)."""
    return checkpoint_problem(ckpt) or model_folder_problem(ckpt / "model")


def _newest_sound_checkpoint(run: str, found: list[Path], exporting: bool = False) -> EvalTarget:
    """The newest of a run's checkpoints whose model checks out, with the newer ones passed over and why."""
    skipped = []
    for ckpt in reversed(found):
        problem = _model_problem(ckpt)
        if problem is None:
            return EvalTarget(str(ckpt / "model"), run, checkpoint_step(ckpt), tuple(skipped))
        skipped.append(f"passing over checkpoint {ckpt.name}: {problem}")
    instead = (
        "Restore the run's checkpoints from a backup: nothing of it can be exported."
        if exporting
        else "Evaluate a model folder instead, or restore the run's checkpoints from a backup."
    )
    raise QAEUserError(
        f"{'run' if exporting else 'model'}: no checkpoint of run '{run}' checks out "
        f"({'; '.join(skipped)[:600]}). {instead}"
    )


def _looks_like_a_run_id(spec: str) -> bool:
    """A bare name (no org/, no path, no built-in prefix) that is no folder here and no model in the Hugging Face
    cache: a run id mistyped, which transformers would otherwise take for a Hub id and retry offline for a minute."""
    if not RUN_NAME_PATTERN.match(spec) or "/" in spec or ":" in spec or Path(spec).exists():
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True
    return not isinstance(try_to_load_from_cache(spec, "config.json"), str)


def export_model(run: str, runs_dir, out: Path, checkpoint: int | None = None) -> EvalTarget:
    """Copy a run's checkpoint model (its newest, or `checkpoint`) to `out` as a Hugging Face folder: config,
    model.safetensors, generation config and tokenizer, what vLLM or the hub take. A sharded run's checkpoint holds
    its full weights there too (gathered once when it was saved), so any run exports the same way; a LoRA run's are
    the merged weights. The checkpoint's checksums are verified first."""
    import shutil

    if not RUN_NAME_PATTERN.match(run) or not (Path(runs_dir) / run).is_dir():
        raise QAEUserError(
            f"run: no run '{run}' in {runs_dir}. `qae export` takes a training run's id (see `qae runs`)."
        )
    target = resolve_model(run, runs_dir, checkpoint, exporting=True)
    ckpt = Path(target.model_path).parent
    problem = _model_problem(ckpt)
    if problem is not None:
        raise QAEUserError(
            f"checkpoint: {ckpt} does not check out ({problem}). Export another one with --checkpoint N."
        )
    out = Path(out)
    _check_export_folder(out, Path(runs_dir) / run)
    # only what the manifest lists (checked above: regular files inside the checkpoint, checksums matching), so a file
    # slipped into model/ never reaches an export meant for the Hub
    listed = json.loads(read_run_file(ckpt / MANIFEST))
    model_dir = Path(target.model_path).relative_to(ckpt)
    files = sorted(name for name in listed if Path(name).parent == model_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copy2(ckpt / name, out / Path(name).name)
    except OSError as err:
        if environment_errno(err) is None:
            raise QAEUserError(
                f"out: cannot write {out} ({err.strerror or err}). Pass a new or empty folder you can write to."
            ) from None
        raise environment_error(
            f"out: cannot write the export to {out}", err, "The run is unchanged.", then="export again"
        ) from None
    return target


def _check_export_folder(out: Path, run_folder: Path) -> None:
    """Refuse, before anything is written, an --out that cannot become a new folder holding the export."""
    check_path_names("out", out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise QAEUserError(f"out: {out} is a file, not a folder. Pass a new or empty folder.")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise QAEUserError(f"out: {parent} is a file, so {out} cannot be made under it. Pass a new or empty folder.")
    resolved = out.resolve()
    if resolved == run_folder.resolve() or run_folder.resolve() in resolved.parents:
        raise QAEUserError(f"out: {out} is inside the run's own folder ({run_folder}). Export to a folder outside it.")
    if out.exists() and any(out.iterdir()):
        raise QAEUserError(f"out: {out} is not empty. Pass a new or empty folder.")


def evaluate_with_progress(
    cfg: EvalConfig, engine, name: str, problems, prompts, task, max_new_tokens: int, console=None
) -> EvalResult:
    """`qae eval`'s samples of every problem, scored with its rewards, under a progress bar on `console`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn(f"[bold]eval {name}"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )
    with RewardSet.of(cfg.reward, cfg.reward_weights, task.reward, cfg.verify_timeout_s) as rewards, progress:
        rewards.check(data_columns(problems))  # (the user's functions imported in its workers, their columns checked)
        bar = progress.add_task("eval", total=len(problems))
        return evaluate(
            engine,
            name,
            problems,
            prompts,
            rewards,
            cfg.samples,
            cfg.temperature,
            max_new_tokens,
            cfg.seed,
            on_batch=lambda n: progress.advance(bar, n),
        )


def _say_target(target: EvalTarget, console) -> None:
    """Which checkpoint of a run is evaluated, and the newer ones passed over (with why)."""
    if console is None or target.run_id is None:
        return
    from rich.markup import escape

    for skipped in target.skipped:
        console.print(f"[yellow]warning:[/] {escape(skipped)}", highlight=False)
    console.print(f"run {target.run_id}: evaluating its checkpoint at step {target.step}", highlight=False)


def _say_trained_options(cfg: EvalConfig, target: EvalTarget, runs_dir, bench_reward: str, console) -> None:
    """A run evaluated without the rewards it trained with: said, as qae eval never takes reward code from a run
    folder (it runs only when the user names it)."""
    if console is None or target.run_id is None:
        return
    try:
        stored = read_run_config(Path(runs_dir) / target.run_id)
    except QAEUserError:
        return  # (the run's own commands say what is wrong with its config.json)
    from rich.markup import escape

    trained = stored.get("reward") if isinstance(stored.get("reward"), list) else []
    rewards = [f"--reward {shlex.quote(v)}" for v in trained if isinstance(v, str)] if cfg.reward is None else []
    if rewards:
        console.print(
            f"[yellow]note:[/] run {target.run_id} trained with {escape(' '.join(rewards))}; this "
            f"evaluation scores with the bench's own reward ({bench_reward}). Pass the same --reward "
            "options to score as it trained.",
            highlight=False,
        )


def sampling_columns(cfg: EvalConfig) -> dict:
    """How an evaluation sampled, stored with each of its `evals` rows (docs/store.md)."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "samples": cfg.samples, "problem_limit": cfg.limit}


def sampling_header(
    cfg: EvalConfig,
    name: str,
    n_problems: int,
    total: int,
    max_new_tokens: int,
    run: str | None = None,
    taken: tuple[str, ...] = (),
) -> str:
    """What `qae eval` prints before it samples: the benchmark, how many problems and how each is sampled, and which
    of those settings are the run's own (`taken`: the options it took from run `run`)."""
    limited = f" (--limit {cfg.limit} of {total})" if cfg.limit and cfg.limit < total else ""
    extra = "".join(
        f", {flag} {value:g}"
        for flag, value, off in (("top-k", cfg.top_k, 0), ("min-p", cfg.min_p, 0.0))
        if value != off
    )
    text = (
        f"eval {name}: {n_problems} problems{limited}, {cfg.samples} samples each at temperature "
        f"{cfg.temperature:g}, top-p {cfg.top_p:g}{extra}, max-new-tokens {max_new_tokens}"
    )
    if run is not None and taken:
        text += f"; {', '.join(option.replace('_', '-') for option in taken)} as run {run} trained"
    return text


def eval_problems(cfg: EvalConfig, trained=None) -> tuple[str, list[Problem], object]:
    """(name, problems, task) that `qae eval` evaluates: --bench, or with --split heldout the held-out split of the
    run `trained` (its stored TrainConfig)."""
    if cfg.split is None:
        return run_benchmark(cfg, cfg.bench, "bench")
    import dataclasses

    from qae_app.scoring.reward_path import run_task

    # the run's task, its data split as it split it, prompted with the evaluation's options (the run's unless given)
    task = run_task(
        dataclasses.replace(
            trained, prompt_template=cfg.prompt_template, system_prompt=cfg.system_prompt, reward=cfg.reward
        )
    )
    return f"{task.name}-heldout", task.heldout, task


def run_eval_command(
    cfg: EvalConfig, runs_dir, console=None, trained=None, taken: tuple[str, ...] = ()
) -> tuple[EvalResult, str, Path]:
    """Everything `qae eval` does; returns (EvalResult, run_id the results were stored under, database path).
    `trained`: the stored config of the run --model names (cli/trained_defaults.eval_config_for), whose options `taken`
    are this evaluation's."""
    from qae_app.engines.factory import make_engine
    from qae_app.models.policy import check_prompt_lengths, load_policy, rollout_positions

    target = resolve_model(cfg.model, runs_dir, cfg.checkpoint)
    _say_target(target, console)
    name, problems, task = eval_problems(cfg, trained)
    _say_trained_options(cfg, target, runs_dir, task.reward, console)
    total = len(problems)
    problems = problems[: cfg.limit] if cfg.limit else problems
    max_new_tokens = cfg.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task.reward]
    run_id, writer = _results_run(cfg, target, runs_dir)
    if console is not None:  # (once the run's file took the writer: a damaged one is refused before this)
        console.print(
            sampling_header(cfg, name, len(problems), total, max_new_tokens, target.run_id, taken), highlight=False
        )
    try:
        policy, codec = load_policy(target.model_path, cfg.dtype)
    except QAEUserError:
        if target.run_id is None or cfg.checkpoint is not None or Path(target.model_path).exists():
            raise
        # the run is training and pruned the checkpoint chosen (--keep-checkpoints) before it was loaded: take the
        # newest again (a newer one than the pruned, which the trainer keeps for at least a checkpoint interval)
        target = resolve_model(cfg.model, runs_dir)
        policy, codec = load_policy(target.model_path, cfg.dtype)
    prompts = [task.prompt(p) for p in problems]
    by_id = list(zip([p.prompt_id for p in problems], prompts, strict=True))
    check_prompt_lengths(policy, codec, by_id, max_new_tokens, "bench", cfg.system_prompt)
    rollout_engine = make_engine(
        cfg.engine,
        policy,
        codec,
        model_path=target.model_path,
        sampling=SamplingOptions(cfg.top_p, cfg.top_k, cfg.min_p),
        gpu_memory_utilization=cfg.vllm_gpu_memory,
        sleep=False,  # (no update to sleep in)
        max_model_len=rollout_positions(policy, codec, by_id, max_new_tokens),
    )
    try:
        result = evaluate_with_progress(cfg, rollout_engine, name, problems, prompts, task, max_new_tokens, console)
    finally:
        rollout_engine.close()  # (vLLM: its engine and process group, before the results are written)

    path = db_path(runs_dir, run_id)
    _store_results(writer or RunWriter(path, run_id), cfg, target, run_id, name, max_new_tokens, result, console)
    return result, run_id, path


def _results_run(cfg: EvalConfig, target, runs_dir) -> tuple[str, RunWriter | None]:
    """The run the results go to and its writer: the evaluated run's own, or a new eval run (its writer made once
    there are results to put in it), whose name is refused now if taken."""
    if target.run_id is None:
        run_id = validate_run_name(cfg.run_name or f"eval-{datetime.now():%Y%m%d-%H%M%S}")
        if db_path(runs_dir, run_id).parent.exists():  # a run, or what is left of one (checkpoints, config.json)
            raise QAEUserError(f"run-name: '{run_id}' already exists in {runs_dir}. Pick another --run-name.")
        return run_id, None
    # the run's own file takes the results: refused now if it cannot, not after the evaluation
    return target.run_id, RunWriter(db_path(runs_dir, target.run_id), target.run_id)


def _store_results(
    writer: RunWriter, cfg: EvalConfig, target, run_id: str, name: str, max_new_tokens: int, result: EvalResult, console
) -> None:
    """Write the metrics and samples at the evaluated step (a new eval run: created, then finished); a database
    held by another process gets them under pending/."""
    if target.run_id is None:
        options = dict(cfg.to_dict(), max_new_tokens=max_new_tokens)
        writer.create_run(run_id, options, "eval", None, cfg.model, cfg.bench, cfg.seed)
    writer.add_step(
        target.step,
        evals=[{**m, "source": "eval", **sampling_columns(cfg)} for m in result.metrics],
        eval_samples=[{**s, "benchmark": name, "source": "eval"} for s in result.samples],
    )
    if target.run_id is None:
        writer.update_run(status="finished")
    if not writer.wait_until_written(timeout_s=60):
        writer.sync_pending()  # they wait there for the run's next writer, maybe across a reboot
        if console is not None:
            console.print(
                f"[yellow]{writer.path} is {writer.holder}: the results are saved under "
                f"{writer.pending_dir} and written by the run's next writer.[/]"
            )
