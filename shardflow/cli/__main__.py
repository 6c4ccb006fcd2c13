"""``python -m shardflow.cli``."""

import sys

from . import main

sys.exit(main())
