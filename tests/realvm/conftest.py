"""The session's lab guest image, a fixture of every real-guest test (built once, kept in the lab cache)."""

from __future__ import annotations

import pytest

from tests.realvm import LAB_CACHE, load_builder
from tests.support.realdev import require_root
from tests.support.tiers import starts


@pytest.fixture(scope="session")
@starts("lab")
def lab_guest_image():
    """The lab guest image for the current inputs: built (apt-get download + dpkg-deb -x) on first use."""
    require_root()
    return load_builder().ensure_guest_image(LAB_CACHE)
