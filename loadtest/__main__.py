"""`python -m loadtest [flags]` is `pdserve-bench [flags]`."""

from __future__ import annotations

import sys

from loadtest.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
