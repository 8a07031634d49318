import sys

from zcompile.cli import main

sys.exit(main())
