"""`python -m fsdp2_compile`: the `fsdp2-compile` command line."""

import sys

from .cli import main

sys.exit(main())
