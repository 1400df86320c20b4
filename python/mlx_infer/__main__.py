"""``python -m mlx_infer`` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
