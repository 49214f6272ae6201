"""docs/schemas is generated from the models and must not drift from them."""

from gpuaas_agent.contract.schemas import render
from tests.conftest import REPO

SCHEMAS = REPO / "docs" / "schemas"


def test_committed_schemas_match_the_models():
    rendered = render()
    committed = {p.name: p.read_text() for p in SCHEMAS.glob("*.json")}
    assert sorted(committed) == sorted(rendered), "run: python -m gpuaas_agent.contract.schemas docs/schemas"
    for name, text in rendered.items():
        assert committed[name] == text, f"{name} drifted; regenerate docs/schemas"


def test_every_schema_forbids_unknown_fields():
    import json

    for name, text in render().items():
        assert json.loads(text).get("additionalProperties") is False, name
