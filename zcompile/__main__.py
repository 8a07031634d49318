import sys

from zcompile.tools.cli import main

sys.exit(main())
