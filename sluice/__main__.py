"""`python -m sluice ...` is the `sluice` command."""

import os
import sys

# `-m` puts the working directory first on sys.path. In a checkout of sluice that directory holds kernels/, which
# would shadow the Hub's `kernels` package that transformers imports (here and in the spawned engine process, which
# inherits this path); sluice's own modules come from its install, not from the working directory.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.getcwd()]

from sluice.worker.cli import main  # noqa: E402

sys.exit(main())
