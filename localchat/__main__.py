"""``python -m localchat``: the ``localchat`` command."""

import sys

from localchat.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
