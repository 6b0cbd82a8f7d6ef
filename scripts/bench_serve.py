#!/usr/bin/env python
"""Benchmark the completions server under load against static batching: see `plugins/bench/serving.py`
(also `python -m plugins.bench.serving`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.bench.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
