"""``python -m mtp_hooks``: the same CLI as the ``mtp-hooks`` console script."""

from .cli import main

raise SystemExit(main())
