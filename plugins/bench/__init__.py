"""The cross-library comparison (`scripts/compare.py`): bench configs (config.py), machine probes
(probes.py), the grid of backends x batches x prompt lengths (grid.py), the analytical roofline
(roofline.py) and the reports (report.py)."""
