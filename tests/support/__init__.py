"""What the tests share and that is not a test: helpers they import
(`contract_model`, `fast_loop`, `keras_optimizers`) and, in `jobs/`, the scripts
some of them start in subprocesses (plain scripts, not modules of this package).
"""

import pathlib

JOBS = pathlib.Path(__file__).resolve().parent / "jobs"
