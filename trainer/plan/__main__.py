"""`python -m trainer.plan`: see `trainer.plan`."""

import sys

from trainer.plan import main

sys.exit(main())
