"""`python -m dspark_jax.datagen`: regenerate training responses with the target.

The implementation lives in `dspark_jax.data.datagen` (see its docstring for the options and the
output format); this module is only the command-line entry point.
"""

import sys

from dspark_jax.data.datagen import main

if __name__ == "__main__":
    sys.exit(main())
