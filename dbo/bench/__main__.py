"""`python -m dbo.bench ...` (see `dbo.bench` for the commands)."""
import sys

from dbo.bench import main

if __name__ == "__main__":
    sys.exit(main())
