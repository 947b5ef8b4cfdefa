"""``python -m feeder.doctor``: the same as the ``feeder-doctor`` command."""

import sys

from . import main

sys.exit(main())
