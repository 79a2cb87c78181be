from tests.recipe.conftest import tokenizer_path  # noqa: F401  (the V4.1 tokenizer.json fixture)

import pytest


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="session")
def engine(checkpoint):
    from deepinfer import AsyncEngine, EngineArgs
    eng = AsyncEngine(EngineArgs.from_kwargs(str(checkpoint), max_model_len=1024, max_num_seqs=8))
    yield eng
    eng.shutdown()
