"""The `fsdp2-compile` command line (dump, plan). Importing it imports no torch: `--help` answers at once."""
