"""``python -m deepreduce <command>``: see ``deepreduce.cli``."""
import sys

from .cli import main

sys.exit(main())
