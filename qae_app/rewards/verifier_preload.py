"""Imported once by the math verifier's fork server (see `verifier_pool._worker_context`): imports math-verify and sympy
and runs each of its parsers once, so every worker forked from the server starts warm, in milliseconds.

Any failure here is left for the workers to meet and report (they import and warm up again): the fork server must
start whatever happens."""

import logging

try:
    from qae_app.rewards.verifier_pool import verify_math

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" is expected in the workers
    for prediction, gold in (("1", "1"), ("\\frac{1}{2}", "0.5"), ("x^2", "x^{2}"), ("\\sqrt{2}", "2^{1/2}")):
        verify_math(prediction, gold)
except Exception:  # noqa: BLE001
    pass
