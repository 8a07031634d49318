import os
import shutil
import sys
import tempfile

# Spawned workers unpickle functions from `tests.*`: the repository root must be importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A cache directory of this session (inductor's FX graph cache and AOTAutograd's, where zcompile's compile cache
# lives), inherited by the spawned workers: every run starts cold as on a clean CI machine, instead of loading
# graphs an earlier run stored in the user's own cache. A directory the user set is kept.
_OWN_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zcompile-tests-inductor-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Every test worker, also those of the benchmark scripts the tests run, forks from a server that imported (and worked
# out) once what each worker's first compile needs: about 4 s less per world on 2 cores (tests/worker_preload.py).
os.environ.setdefault("ZC_WORKER_PRELOAD", "tests.worker_preload")
