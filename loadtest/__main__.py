"""`python -m loadtest [flags]` is `pdserve bench [flags]`."""

from __future__ import annotations

import sys

from services.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
