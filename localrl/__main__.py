"""``python -m localrl ...``: the same as the ``localrl`` command."""

import sys

from localrl.cli import entry

sys.exit(entry())
