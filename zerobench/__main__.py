"""``python -m zerobench ...``: the same command line as ``zerobench ...``."""

import sys

from zerobench.cli import main

sys.exit(main())
