import sys

from kspeed.manager.daemon import main

sys.exit(main())
