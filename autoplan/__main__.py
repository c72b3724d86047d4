"""`python -m autoplan` runs the same command line as the `autoplan` script."""

from autoplan.cli import main

raise SystemExit(main())
