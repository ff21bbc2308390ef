"""How the tests start `accelerate launch` on this one machine."""

import shutil
import sys
from pathlib import Path

ACCELERATE = shutil.which("accelerate", path=str(Path(sys.executable).parent))

# Each launch on a free port of its own (accelerate picks one for port 0): every launch that names no port takes
# accelerate's default, 29500, and two tests launching at once (pytest-xdist's workers) race for it between
# accelerate's "is it in use?" check and torch's bind; the loser dies before its run folder exists.
ONE_MACHINE = ("--num_machines", "1", "--main_process_port", "0")
