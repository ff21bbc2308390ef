"""qae_app/train: the trainer end to end on the built-in task, the update, DAPO's additions, the memory options,
checkpoints, entropy attribution and the recipes. The fixtures (tiny_run: a real finished run) and TINY_RUN_OPTIONS
are tests/conftest.py's."""
