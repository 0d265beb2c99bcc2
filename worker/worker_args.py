"""The worker's command-line flags, shared by `python -m worker` and `deltaserve worker` (no
torch here: the CLI declares them before anything heavy is imported)."""
from __future__ import annotations

import argparse

from common.worker_auth import SECRET_ENV


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, help="the engine core's worker address")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--worker-secret-file",
                        help=f"the engine's worker secret (default: ${SECRET_ENV})")
