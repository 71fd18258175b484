"""``python -m conveyor ...`` runs the ``conveyor`` command, as LMDeploy's docs run ``python3 -m lmdeploy``."""

from conveyor.cli import main

raise SystemExit(main())
