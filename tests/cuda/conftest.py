import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here needs a GPU: it carries the ``cuda`` marker (tests/conftest.py skips
    those without CUDA; ``pytest -m cuda`` runs only them)."""
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
