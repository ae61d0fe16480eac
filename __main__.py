"""``python -m wan_accel``: the command line."""
from .cli import main

raise SystemExit(main())
