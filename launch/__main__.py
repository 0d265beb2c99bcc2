"""`python -m launch ...` is the `deltaserve` command."""
import sys

from launch.cli import main

sys.exit(main())
