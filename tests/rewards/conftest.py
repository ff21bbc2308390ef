"""qae_app/rewards: answer extraction, the reward functions and math-verify in a pool of workers with a deadline,
also on hostile model outputs inside a real step. The fixtures are tests/conftest.py's."""
