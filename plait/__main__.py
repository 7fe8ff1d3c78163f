"""`python -m plait serve ...` (same as the `plait` console script)."""

import sys

from plait._paths import drop_checkout_root

drop_checkout_root()  # run from a checkout, its kernels/ would shadow PyPI's `kernels`

from plait.cli import main  # noqa: E402

sys.exit(main())
