"""``python -m mlx_infer.cli``: the same as the ``mlx-infer`` command."""

import sys

from . import main

sys.exit(main())
