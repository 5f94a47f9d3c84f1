"""``python -m sits_lora``: the ``sits-lora`` command line without an installed console script."""

import sys

from .cli import main

sys.exit(main())
