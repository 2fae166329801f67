"""``python -m probkv.cli``: the ``probkv`` command."""

import sys

from probkv.cli.main import main

sys.exit(main())
