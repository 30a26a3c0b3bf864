"""`python -m services.worker [--config FILE] [--engine sim|vllm] [--nodes N]`.

`--engine` and `--nodes` override `worker.engine` and `worker.nodes`, as their
KVLANE__WORKER__* variables would.
"""

import os
import sys

from services.worker.main import command_line_overrides, main
from shared.runner import run_service

argv, overrides = command_line_overrides(sys.argv[1:])
os.environ.update(overrides)
run_service("worker", main, argv)
