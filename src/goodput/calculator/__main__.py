"""`python -m goodput.calculator SUBCOMMAND ...`: see goodput.calculator.cli."""

import sys

from goodput.calculator.cli import main

sys.exit(main())
