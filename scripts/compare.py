#!/usr/bin/env python
"""Benchmark every backend on the same weights: see `plugins/bench/cli.py` (also `mqa-compare` and
`python -m plugins.bench`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
