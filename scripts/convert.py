#!/usr/bin/env python
"""Convert gpt_bigcode checkpoints between HF and Megatron formats: see `converters/cli.py` (also
`mqa-convert` and `python -m converters`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from converters.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
