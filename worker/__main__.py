"""`python -m worker --connect ADDR --rank R` (also `deltaserve worker`)."""
import sys

from worker.worker_proc import main

sys.exit(main())
