import os
import sys

# Spawned workers unpickle functions from `tests.*`: the repository root must be importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
