#!/usr/bin/env python
"""Serve a checkpoint from replicas behind vLLM's router: see `plugins/fleet/cli.py` (also `mqa-fleet`
and `python -m plugins.fleet`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.fleet.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
