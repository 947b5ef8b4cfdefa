"""``python -m feeder.bench``."""

import sys

from .cli import main

sys.exit(main())
