"""ImageRef on the wire: the declared size is optional, positive, and nothing else is accepted."""

import pytest
from pydantic import ValidationError

from gpuaas_agent.contract.tasks import ImageRef

DIGEST = "ab" * 32


def test_size_is_optional_and_kept_when_given():
    assert ImageRef(url="https://images.example.com/a.raw", sha256=DIGEST).size_bytes is None
    assert ImageRef(url="file:///srv/images/a.raw", sha256=DIGEST, size_bytes=4096).size_bytes == 4096


@pytest.mark.parametrize("extra", [{"size_bytes": 0}, {"size_bytes": -1}, {"size_bytes": "big"},
                                   {"size": 4096}, {"actual_sha256": DIGEST}])
def test_bad_or_unknown_size_fields_are_refused(extra):
    with pytest.raises(ValidationError):
        ImageRef.model_validate({"url": "https://images.example.com/a.raw", "sha256": DIGEST, **extra})


@pytest.mark.parametrize("url", ["FILE:///srv/images/a.raw", "http://127.0.0.1/a.raw", "/srv/images/a.raw"])
def test_only_lower_case_https_and_file_urls_reach_the_agent(url):
    with pytest.raises(ValidationError):
        ImageRef(url=url, sha256=DIGEST)
