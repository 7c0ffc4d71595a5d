"""`python -m launch.memory`: the command line of launch.memory.report."""

import sys

from launch.memory.report import main

sys.exit(main())
