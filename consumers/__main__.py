"""``python -m consumers``: see :mod:`consumers._cli`."""

import sys

from ._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
