"""``python -m kvcanary_cupy`` is the ``kvcanary`` command."""

from .cli import main

raise SystemExit(main())
