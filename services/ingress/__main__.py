"""`python -m services.ingress [--config FILE] [--processes N]`.

`--processes N` overrides `ingress.processes`. With more than one, this
process supervises that many sibling ingress processes on the port and
serves nothing itself; the multiprocess metrics directory is set up here,
before prometheus_client is imported (services/ingress/processes.py), and
removed at exit.
"""

import argparse
import os
import shutil

from services.ingress.processes import prepare_metrics_dir
from shared.config import ENV_PREFIX, ConfigError, load_config


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


parser = argparse.ArgumentParser(prog="python -m services.ingress")
parser.add_argument("--config", help="TOML configuration file (default: $KVLANE_CONFIG, else built-in defaults)")
parser.add_argument("--processes", type=_count, help="ingress processes sharing the HTTP port (default: ingress.processes, 1)")
args = parser.parse_args()
if args.processes is not None:
    os.environ[f"{ENV_PREFIX}INGRESS__PROCESSES"] = str(args.processes)
try:
    processes = load_config(args.config).ingress.processes
except ConfigError:
    processes = 1  # run_service reports the error
made_metrics_dir = prepare_metrics_dir(processes)

from services.ingress.main import main  # noqa: E402 - after the metrics directory is set up
from services.ingress.processes import supervise  # noqa: E402
from shared.runner import run_service  # noqa: E402

try:
    run_service("ingress", supervise if processes > 1 else main, ["--config", args.config] if args.config else [])
finally:
    if made_metrics_dir is not None:
        shutil.rmtree(made_metrics_dir, ignore_errors=True)
