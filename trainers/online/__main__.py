"""`python -m trainers.online [--config FILE] [key=value ...]`: the same process as `dvi train --online`."""

import sys

from dvi.cli import main

sys.exit(main(["train", "--online", *sys.argv[1:]]))
