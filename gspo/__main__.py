import sys

from gspo.cli import main

sys.exit(main())
