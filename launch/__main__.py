"""`python -m launch ...` is the `deltaserve` command."""
import sys

from launch.cli.main import main

sys.exit(main())
