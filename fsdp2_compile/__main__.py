"""`python -m fsdp2_compile`: the `fsdp2-compile` command line."""

import sys

from fsdp2_compile.cli.main import main

sys.exit(main())
