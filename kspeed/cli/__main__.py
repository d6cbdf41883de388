"""``python -m kspeed.cli`` runs the ``kspeed`` command."""

import sys

from kspeed.cli.main import main

sys.exit(main())
