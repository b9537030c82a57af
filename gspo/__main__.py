import sys

from gspo.apps.cli import main

sys.exit(main())
