"""Shared helpers of the test suite.

How tests import things: ``tests/`` is not a package. This conftest puts the repository root
and the ``tests/`` directory at the front of ``sys.path``, so that a test module (or a
benchmark run from the repository root) can write ``import rkgb``, ``from rockmate import ...``
and ``from zoo import ZOO`` without installing the project. Helpers meant for several test
modules live in ``zoo.py`` (models) or here (fixtures and functions).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (_TESTS_DIR.parent, _TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread unless ROCKMATE_TEST_THREADS says otherwise. The machines of this project
# have two cores shared by parallel test runs; when two processes each run two OpenMP threads,
# the threads spin at barriers and a 4 ms step of a zoo model can take 2 s. With one thread
# per process the same step takes 4 to 13 ms, loaded or not.
torch.set_num_threads(int(os.environ.get("ROCKMATE_TEST_THREADS", "1")))

# Hermetic plans: no options read from (or written to) the user's disk cache of plans; the
# cache's own tests give it a directory of their own.
os.environ.setdefault("ROCKMATE_CACHE_DIR", "off")


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's random generators (torch's on every device)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def seeded() -> int:
    """Seed every generator with 0 before the test; the value is the seed."""
    seed_everything(0)
    return 0


try:  # hypothesis profiles of tests/test_fuzz.py: "ci" by default, --hypothesis-profile=long
    from hypothesis import HealthCheck, Phase, settings

    _FUZZ = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True, derandomize=True,
                 database=None)
    # CI does not shrink: a failure's program is printed as drawn (shrinking one took > 5 min)
    settings.register_profile("ci", max_examples=70, phases=[Phase.explicit, Phase.generate], **_FUZZ)
    settings.register_profile("long", max_examples=2000, **_FUZZ)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
