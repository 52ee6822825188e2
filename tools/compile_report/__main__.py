"""``python -m tools.compile_report``: the compile report's command line (``report.main``)."""

import sys

from tools.compile_report.report import main

# guarded: the report's compile workers are spawned processes, which import this module again
if __name__ == "__main__":
    sys.exit(main())
