"""`python -m plugins.kernels`: which linear implementation this machine runs, per dtype and rows.

`--lower-rungs` prints the rungs below this machine's own (what `make test` forces in turn).
"""

import argparse
import json

from . import RUNGS, probe

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--lower-rungs", action="store_true", help="print the rungs below this machine's, one line")
args = ap.parse_args()
p = probe()
if args.lower_rungs:
    print(" ".join(RUNGS[RUNGS.index(p.rung) + 1:]))
else:
    print(json.dumps(p.describe(), indent=1))
