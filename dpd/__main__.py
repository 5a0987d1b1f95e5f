import sys

from dpd.cli import main

sys.exit(main())
