"""`python -m dbo.cli <command> ...`: the `dbo` command (use it under torchrun)."""
import sys

from dbo.cli import main

if __name__ == "__main__":
    sys.exit(main())
