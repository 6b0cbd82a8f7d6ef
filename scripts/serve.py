#!/usr/bin/env python
"""Serve a checkpoint over an OpenAI-compatible HTTP API: see `plugins/http/cli.py` (also `mqa-serve`
and `python -m plugins.http`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.http.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
