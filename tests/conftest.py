import pytest


@pytest.fixture(scope="session")
def prepared_model():
    """The default model's folder, prepared once in the user's cache (later runs find it ready)."""
    from lit_trainer.models import prepare_default_model

    return prepare_default_model().path
