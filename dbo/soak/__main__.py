"""`python -m dbo.soak`: see dbo.soak."""
import sys

from dbo.soak.run import main

sys.exit(main())
