"""``python -m steergate.cli`` is the ``steergate`` command."""

import sys

from steergate.cli.main import main

sys.exit(main())
