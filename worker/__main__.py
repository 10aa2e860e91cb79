"""`python -m worker ...` is the `sluice` command."""

import sys

from worker.cli import main

sys.exit(main())
