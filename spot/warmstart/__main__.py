"""`python -m spot.warmstart`: the command line of spot.warmstart.train."""

import sys

from spot.warmstart.train import main

sys.exit(main())
