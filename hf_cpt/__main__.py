"""``python -m hf_cpt``: the command line of `hf_cpt.cli`."""

import sys

from .cli import main

sys.exit(main())
