"""Every cell of tests/test_strategy_grid.py under real MPI, in one launch (run by that test)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
from test_strategy_grid import report_grid  # noqa: E402

from minitrain.comm import init  # noqa: E402

report_grid(init(comm_timeout=30))
