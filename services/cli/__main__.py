"""``python -m services.cli``: the ``streamppo`` command."""

import sys

from services.cli.main import main

sys.exit(main())
