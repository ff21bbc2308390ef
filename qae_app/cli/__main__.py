"""`python -m qae_app.cli ...`: what `accelerate launch -m qae_app.cli train ...` runs on every process."""
import sys

from qae_app.cli.main import app

sys.exit(app())
