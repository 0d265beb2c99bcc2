"""Progress bars of model downloads and conversions: tqdm on stderr, only when it is a
terminal (logs and captured output stay free of bar redraws)."""
from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar, disabled unless `enabled` and stderr is a terminal."""
    return tqdm(disable=not (enabled and on_terminal()), dynamic_ncols=True, **kwargs)
