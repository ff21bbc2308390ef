"""One registry of rewards: the built-in verifiers and the user's own functions, named the same way (specs.py), scored
by one object, `RewardSet`, that the trainer, `qae eval` and `qae preview` all use:

    with RewardSet.of(cfg.reward, cfg.reward_weights, task.reward, timeout_s=3.0) as rewards:
        files = rewards.check(columns)                       # user code: importable, asks only for columns there are
        totals, components = rewards.score(completions, prompts, problems, step, completion_ids)
        correct, verified = rewards.correct(components), rewards.verified(components)

Without --reward a run's rewards are its task's one built-in verifier, weight 1: its verdicts are the rewards.

**The total** of a response is the weighted sum of its components, `sum(weight * value)`:

- a built-in verifier's component is its verdict (1 correct, 0 wrong, None could not verify); its value in the sum is
  `--reward-values`' correct or wrong reward (0/1 by default, so the value is the verdict; None counts wrong);
- a user function's component is its score, any finite number; None ("could not verify", or no answer within
  --verify-timeout-s) counts 0 in the sum. A function returning a dict gives one component per key, each weighted by
  the function's weight.

The overlong penalty (DAPO) is not part of the total: the trainer adds it (scoring/reward_path.py score_batch).

**Correct** (the `correct` column, `accuracy`, `n_correct`, avg@k) means full marks: every component with a positive
weight at its full mark, a built-in's verdict 1 or a user's score >= 1.0 (scale a reward to [0, 1] for this to read
"solved"). With one binary reward it is the verifier's verdict; with a continuous one, the share of responses at the
top score. `reward_mean` reports the mean total whatever the rewards. **Verified** means no component is None.

User functions run in a `MathVerifierPool`'s worker processes (user_functions.py), one response per call, each under
--verify-timeout-s. A response the function does not score in time gets None, counted in `timeout_warning`; a
function that raises, returns another number of scores than completions, NaN, infinity or a non-number, or answers no
response of a call in time, raises `RewardError`: one message, the user's traceback shown once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.rewards.builtin_verifiers import ANSWER_EXTRACTORS, BuiltinVerifier
from qae_app.rewards.specs import RewardSpec, parse_reward_spec, parse_reward_specs, parse_reward_weights
from qae_app.rewards.user_functions import PASSED_ALWAYS, handle_item, load_user_rewards
from qae_app.rewards.verifier_pool import MathVerifierPool, WorkersDidNotStart

PROBE_TIMEOUT_S = 30.0  # how long a worker may take to say what a function asks for (its import is the startup's)
START_TIMEOUT_S = 120.0  # how long a worker may take to import the user's functions (and warm math-verify first)


class RewardScores(NamedTuple):
    totals: list[float]  # [N] the weighted sum of each response's components (before the overlong penalty)
    components: dict[str, list[float | None]]  # name -> [N] each response's value; None: could not verify


class RewardError(QAEUserError):
    """A user's reward function failed (raised, returned a bad value, hung): the run stops, failed, with this text.
    `spec`: the reward that failed, where one did (the resume advice differs for a file of the user's and an installed
    module's function)."""

    def __init__(self, message: str, spec: RewardSpec | None = None):
        super().__init__(message)
        self.spec = spec


def reward_inputs(completion: str, prompt) -> tuple[object, object]:
    """(completion, prompt) as TRL's GRPOTrainer hands them to a reward function: for conversational data (the prompt
    a list of chat messages: scoring/reward_path.reward_prompt gives one where the model was sent the row's own
    messages) the completion as a list of one assistant message and the prompt as its messages; otherwise both as the
    text they are."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": completion}], [dict(message) for message in prompt]
    return completion, prompt


class RewardSet:
    """The rewards of a run or an evaluation, weighted; use as a context manager (it owns worker processes).

    specs: the rewards (specs.parse_reward_spec); weights: one per spec (default 1 each); timeout_s: each response's
    deadline in a verifier or user-function worker (--verify-timeout-s); values: (wrong, correct), what a built-in
    verdict is worth in the total (--reward-values)."""

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        weights: Sequence[float] | None = None,
        timeout_s: float = 3.0,
        values: tuple[float, float] = (0.0, 1.0),
        verifiers: dict[str, BuiltinVerifier] | None = None,
    ):
        self.specs = list(specs)
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.specs)
        self.timeout_s, self.values = timeout_s, values
        self.user_specs = [spec for spec in self.specs if spec.is_user_code]
        resolved = [spec.resolved() for spec in self.user_specs]  # (a missing file is named before any worker starts)
        self.verifiers = verifiers or {
            spec.target: BuiltinVerifier(spec.target, timeout_s) for spec in self.specs if not spec.is_user_code
        }
        self.user_pool = (
            MathVerifierPool(
                timeout_s=timeout_s,
                memory_limit_mb=None,
                shortcuts=False,
                startup_timeout_s=START_TIMEOUT_S,
                handler=handle_item,
                init=(load_user_rewards, resolved),
            )
            if self.user_specs
            else None
        )
        self.weight_of: dict[str, float] = {spec.name: w for spec, w in zip(self.specs, self.weights, strict=True)}
        self.builtin_names = {spec.name for spec in self.specs if not spec.is_user_code}
        self.last_timeouts: dict[str, int] = {}  # spec text -> responses of the last call scored None at the deadline

    @classmethod
    def of(
        cls,
        reward: list[str] | None,
        reward_weights: str | None,
        default: str,
        timeout_s: float = 3.0,
        values: tuple[float, float] = (0.0, 1.0),
    ) -> RewardSet:
        """The rewards the user named (--reward, --reward-weights), else the task's `default` built-in."""
        specs = parse_reward_specs(reward) if reward else [parse_reward_spec(default)]
        return cls(specs, parse_reward_weights(reward_weights, len(specs)), timeout_s, values)

    @classmethod
    def of_verifier(cls, verifier: BuiltinVerifier) -> RewardSet:
        """The RewardSet of one built-in reward's `BuiltinVerifier` that the caller made (closing either closes it)."""
        return cls([parse_reward_spec(verifier.name)], verifiers={verifier.name: verifier})

    @property
    def pool(self) -> MathVerifierPool | None:
        """The worker pool whose counters (timeouts, crashes, ...) say how scoring went: the built-in math
        verifier's where the set has one, else the user functions'."""
        return next((s.pool for s in self.verifiers.values() if s.pool is not None), self.user_pool)

    @property
    def name(self) -> str:
        return " + ".join(spec.text for spec in self.specs)

    # -- before the first score -----------------------------------------------------------------------------------

    def check(self, columns: Iterable[str]) -> dict[str, dict]:
        """Start the user functions' workers (which import them) and ask each function what it needs: RewardError
        when one cannot be imported, QAEUserError when it requires a column the data lacks (`columns`: the data's
        column names). Returns spec text -> {"path", "sha256"} of each user function's file: the run's record."""
        if self.user_pool is None:
            return {}
        try:
            answers = self.user_pool.run_items(
                [("probe", i) for i in range(len(self.user_specs))], timeout_s=max(self.timeout_s, PROBE_TIMEOUT_S)
            )
        except WorkersDidNotStart as err:
            raise RewardError(self._start_failure(err)) from None
        available = sorted(set(columns) - set(PASSED_ALWAYS))
        record = {}
        for spec, answer in zip(self.user_specs, answers, strict=True):
            if answer is None:
                raise RewardError(
                    f"reward: {spec.text}: its worker did not answer within {PROBE_TIMEOUT_S:g} s of "
                    "starting. Does importing its module wait on something?"
                )
            status, info = answer
            if status == "error":
                raise RewardError(f"reward: {spec.text}: {info}\nFix it and run the command again.")
            missing = [name for name in info["required"] if name not in PASSED_ALWAYS and name not in available]
            if missing:
                raise QAEUserError(
                    f"reward: {spec.text}: the function asks for {', '.join(repr(m) for m in missing)}, which the "
                    f"data does not have. The data's columns: {', '.join(available) or 'none'}; every reward also "
                    f"gets {', '.join(PASSED_ALWAYS)}. Give the parameter a default, take **kwargs, or use data with "
                    "that column."
                )
            record[spec.text] = {"path": info["path"], "sha256": info["sha256"]}
        return record

    def _start_failure(self, err: WorkersDidNotStart) -> str:
        """What it means that the workers importing the user's functions did not start: the import of one of them
        ends the process, or never finishes."""
        named = ", ".join(spec.text for spec in self.user_specs)
        if not err.exit_codes:
            return (
                f"reward: {named}: importing it did not finish within {self.user_pool.startup_timeout_s:.0f} s "
                "(the worker that imports it never said it was ready): does the module sleep, or wait on "
                "something, when it is imported? Fix it and run the command again."
            )
        codes = ", ".join(str(code) for code in err.exit_codes)
        return (
            f"reward: {named}: the worker process importing it ended before it was ready, {len(err.exit_codes)} "
            f"times in a row (exit codes {codes}): does the module end the process when it is imported "
            "(os._exit, a crash in a native library)? Fix it and run the command again."
        )

    # -- scoring --------------------------------------------------------------------------------------------------

    def score(
        self,
        completions: list[str],
        prompts: list,
        problems: Sequence,
        step: int = 0,
        completion_ids: Sequence[list[int]] | None = None,
    ) -> RewardScores:
        """Each response's total and components. completions [N] (text), prompts [N] (as the rewards get them:
        scoring/reward_path.reward_prompt, chat messages for conversational data, else text), problems [N] (each
        with `.answer` and `.columns`, the data row: datasets.Problem) and completion_ids [N] (each response's token
        ids; None: not known, [] each) are aligned; step: the RL step (0 outside training). RewardError when a user
        function fails; `ScoringInterrupted` on shutdown."""
        n = len(completions)
        if not len(prompts) == len(problems) == n:
            raise ValueError(f"{n} completions, {len(prompts)} prompts and {len(problems)} problems")
        answers = [problem.answer for problem in problems]
        components: dict[str, list[float | None]] = {}
        user = (
            self._score_user(completions, prompts, problems, step, completion_ids or [[] for _ in range(n)])
            if self.user_pool is not None
            else {}
        )
        for spec in self.specs:
            parts = (
                {spec.name: self.verifiers[spec.target](completions, answers)}
                if not spec.is_user_code
                else user[spec.text]
            )
            for name, values in parts.items():
                if name in components:
                    raise RewardError(
                        f"reward: {spec.text}: its part '{name}' has the name of another component. "
                        "Name each part and reward apart."
                    )
                components[name] = values
                self.weight_of.setdefault(name, self.weight_of[spec.name])
        return RewardScores(self._totals(components, n), components)

    def _totals(self, components: dict[str, list[float | None]], n: int) -> list[float]:
        """Each response's weighted sum of its components; RewardError where one is not a finite number (weights
        times scores past what a float holds): an advantage or a loss computed from it would be NaN."""
        totals = [0.0] * n
        for part in self.parts(components).values():
            for i, value in enumerate(part):
                totals[i] += value
        for i, total in enumerate(totals):
            if not math.isfinite(total):
                parts = ", ".join(f"{name} {components[name][i]!r} x {self.weight_of[name]:g}" for name in components)
                raise RewardError(
                    f"reward-weights: response {i + 1}'s weighted sum of its rewards is {total} "
                    f"({parts}), past what a number holds. Use smaller --reward-weights, or scale the "
                    "rewards to a range such as [0, 1]."
                )
        return totals

    def parts(self, components: dict[str, list[float | None]]) -> dict[str, list[float]]:
        """Each component's weighted part of each response's total, `weight * value` (a built-in's verdict as its
        --reward-values reward, None as 0): the total is their sum (store/signal.py reads which one varies)."""
        wrong, right = self.values
        parts = {}
        for name, values in components.items():
            weight = self.weight_of[name]
            if name in self.builtin_names:
                parts[name] = [weight * (right if value == 1.0 else wrong) for value in values]
            else:
                parts[name] = [weight * (0.0 if value is None else value) for value in values]
        return parts

    def _score_user(
        self, completions: list[str], prompts: list, problems: Sequence, step: int, completion_ids: Sequence[list[int]]
    ) -> dict[str, dict]:
        """spec text -> {component: [N] scores} of each user function, from the workers."""
        n = len(completions)
        rows = _column_rows(problems)
        inputs = [reward_inputs(completions[i], prompts[i]) for i in range(n)]
        items = [
            ("score", u, *inputs[i], [int(t) for t in completion_ids[i]], rows[i], step)
            for u in range(len(self.user_specs))
            for i in range(n)
        ]
        results = self.user_pool.run_items(items) if items else []
        scored: dict[str, dict[str, list[float | None]]] = {spec.text: {} for spec in self.user_specs}
        self.last_timeouts = {spec.text: 0 for spec in self.user_specs}
        for k, result in enumerate(results):
            u, i = divmod(k, n)
            spec = self.user_specs[u]
            if result is None and k in self.user_pool.died_items:  # (not a deadline: the process ended)
                raise RewardError(
                    f"reward: {spec.text} failed at step {step} on response {i + 1} of {n} "
                    f"({clipped(repr(completions[i]), 60)}): the worker process running it ended "
                    f"(exit code {self.user_pool.died_items[k]}). Does the function end the process "
                    "(os._exit, a crash in a native library)?"
                )
            if result is None:
                self.last_timeouts[spec.text] += 1
                continue
            status, value = result
            if status == "error":
                raise RewardError(
                    f"reward: {spec.text} failed at step {step} on response {i + 1} of {n} "
                    f"({clipped(repr(inputs[i][0]), 80)}): it {value}",
                    spec,
                )
            for part, score in value.items():
                scored[spec.text].setdefault(part or spec.name, [None] * n)[i] = score
        for spec in self.user_specs:
            if n and self.last_timeouts[spec.text] == n:
                raise RewardError(
                    f"reward: {spec.text} scored none of the {n} responses of step {step} within "
                    f"--verify-timeout-s {self.timeout_s:g} s: it hangs, or is far slower than that. "
                    "Fix it (or raise --verify-timeout-s) and resume the run."
                )
            if not scored[spec.text]:
                scored[spec.text][spec.name] = [None] * n
        return scored

    def correct(self, components: dict[str, list[float | None]]) -> list[bool]:
        """Full marks: every component of positive weight at 1 or more (a built-in's verdict 1)."""
        marked = [values for name, values in components.items() if self.weight_of[name] > 0] or list(
            components.values()
        )
        return [
            all(values[i] is not None and values[i] >= 1.0 for values in marked)
            for i in range(len(next(iter(components.values()), [])))
        ]

    @staticmethod
    def verified(components: dict[str, list[float | None]]) -> list[bool]:
        """No component is None."""
        return [
            all(values[i] is not None for values in components.values())
            for i in range(len(next(iter(components.values()), [])))
        ]

    def extract(self, response: str) -> str | None:
        """What maj@k votes on: the first built-in reward's extracted answer, else the whole response, stripped."""
        builtin = next((spec for spec in self.specs if not spec.is_user_code), None)
        return ANSWER_EXTRACTORS[builtin.target](response) if builtin is not None else response.strip()

    def timeout_warning(self, step: int, n: int) -> dict | None:
        """The step's `warnings` row when a user function left responses of the last call unscored at the deadline."""
        late = {text: count for text, count in self.last_timeouts.items() if count}
        if not late:
            return None
        said = "; ".join(f"{text}: {count} of {n}" for text, count in late.items())
        return {
            "kind": "reward_timeout",
            "message": f"step {step}: responses not scored within --verify-timeout-s {self.timeout_s:g} s ({said})"
            ": each scored None (could not verify, counted wrong). Is the function slow on some "
            "inputs? Raise --verify-timeout-s if so.",
        }

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Shutting down: the scoring call in progress stops soon and raises `ScoringInterrupted`."""
        for verifier in self.verifiers.values():
            verifier.interrupt()
        if self.user_pool is not None:
            self.user_pool.interrupt()

    def close(self) -> None:
        for verifier in self.verifiers.values():
            verifier.close()
        if self.user_pool is not None:
            self.user_pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _column_rows(problems: Sequence) -> list[dict]:
    """Each problem's data row as a user function's columns: its fields (None where another row has a field it lacks)
    and `answer`, the gold answer qae read."""
    names = sorted({name for problem in problems for name in (getattr(problem, "columns", None) or {})})
    reserved = set(PASSED_ALWAYS)
    return [
        {
            **{name: (problem.columns or {}).get(name) for name in names if name not in reserved},
            "answer": problem.answer,
        }
        for problem in problems
    ]


def data_columns(problems: Iterable) -> set[str]:
    """Every column name a task's problems carry, and `answer` where every problem has a gold answer: what
    `RewardSet.check` checks a function against."""
    problems = list(problems)
    answered = {"answer"} if all(problem.answer for problem in problems) else set()
    return {name for problem in problems for name in (getattr(problem, "columns", None) or {})} | answered
