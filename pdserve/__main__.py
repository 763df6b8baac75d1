"""`python -m pdserve ...`: the `pdserve` command, for an interpreter or a checkout of choice."""

import sys

from pdserve.cli import main

sys.exit(main())
