"""``python -m kvkernels`` = the ``kvkernels`` command."""

import sys

from .cli import main

sys.exit(main())
