"""`python -m dbo.cli.bench ...` (see `dbo.cli.bench` for the commands)."""
import sys

from dbo.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
