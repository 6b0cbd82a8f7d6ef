#!/usr/bin/env python
"""Train a small code model from a model config's `train:` section: see `plugins/train/cli.py` (also
`mqa-train` and `python -m plugins.train`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
