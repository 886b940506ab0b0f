"""`python -m swarmtrain` runs the CLI."""

import sys

from swarmtrain.daemon.cli import main

sys.exit(main())
