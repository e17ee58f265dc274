"""`python -m extender` is the same as the `vramsched` console script."""

from extender.cli import main

raise SystemExit(main())
