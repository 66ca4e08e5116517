import sys

from aurora.cli import main

sys.exit(main())
