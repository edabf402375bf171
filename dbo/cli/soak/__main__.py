"""`python -m dbo.cli.soak`: see dbo.cli.soak."""
import sys

from dbo.cli.soak.run import main

sys.exit(main())
