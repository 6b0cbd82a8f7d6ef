#!/usr/bin/env python
"""Serve a checkpoint over an OpenAI-compatible HTTP API: see `plugins/serve/cli.py` (also `mqa-serve`
and `python -m plugins.serve`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
