"""`python -m worker --connect ADDR --rank R` (also `deltaserve worker`)."""
import sys

from worker.omp_wait import bound_omp_spinning

bound_omp_spinning()  # before worker_proc imports torch

from worker.worker_proc import main  # noqa: E402

sys.exit(main())
