"""`python -m plugins.kernels`: which linear implementation this machine runs, per dtype and rows.

`--lower-rungs` prints the rungs below this machine's own (what `make test` forces in turn);
`--bench` times santacoder-1b's linears per implementation and row count (plugins.kernels.bench);
`--kind` measures (or reads) the table of one kind only (`make test` times what its tests use first);
`--remeasure` drops this machine's cached table (of `--kind`, or every kind) and times it again;
`--build` compiles every kernel the timing runs and times nothing (`make setup`).
"""

import argparse
import json

from plugins.kernels import KINDS, RUNGS, decision, probe

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--lower-rungs", action="store_true", help="print the rungs below this machine's, one line")
ap.add_argument("--bench", action="store_true", help="time santacoder-1b's linears (2 layers) per row count, ms")
ap.add_argument("--kind", choices=KINDS, help="the table of this kind only (default: every kind)")
ap.add_argument("--remeasure", action="store_true", help="drop the cached table (of --kind) and time it again")
ap.add_argument("--build", action="store_true", help="compile the kernels only: time nothing")
args = ap.parse_args()
if args.remeasure:
    from plugins.kernels.measure import forget

    forget((args.kind,) if args.kind else KINDS)
p = decision() if args.build or args.lower_rungs else probe(args.kind)
if args.build:
    from plugins.kernels.layer_ops import amx_module

    amx_module()  # the AMX decode attention, where this CPU has AMX
if args.bench:
    from plugins.kernels.bench import bench

    print(json.dumps(p.describe()["rung"]))
    for row in bench():
        print("  ".join(f"{k} {v:8.2f}" if isinstance(v, float) else f"{k} {v:3d}" for k, v in row.items()), flush=True)
elif args.lower_rungs:
    print(" ".join(RUNGS[RUNGS.index(p.rung) + 1:]))
else:
    print(json.dumps(p.describe(), indent=1))
