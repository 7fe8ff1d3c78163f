"""`python -m plait serve ...` (same as the `plait` console script)."""

import sys

from plait.cli import main

sys.exit(main())
