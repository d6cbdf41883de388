import sys

from kspeed.server.daemon import main

sys.exit(main())
