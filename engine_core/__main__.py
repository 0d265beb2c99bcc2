"""`python -m engine_core --config JSON --input ADDR --output ADDR --runtime-dir DIR`."""
import sys

from engine_core.engine_core_proc import main

sys.exit(main())
