"""`python -m qae_app.cli ...`: what `accelerate launch -m qae_app.cli train ...` runs on every process."""

import sys

from qae_app.cli import launch
from qae_app.cli.main import app

launch.own_process = True
sys.exit(app())
