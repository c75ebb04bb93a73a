"""``python -m kvtier``: the ``kvtier`` command."""

from kvtier.tools.cli import main

raise SystemExit(main())
