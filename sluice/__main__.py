"""`python -m sluice ...` is the `sluice` command."""

import sys

from sluice.worker.cli import main

sys.exit(main())
