from tests.recipe.conftest import tokenizer_path  # noqa: F401  (the V4.1 tokenizer.json fixture)

import pytest

from tests.serving.checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    out = build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    if out is None:
        pytest.skip("no checkpoint generator (deepinfer.cli.make_checkpoint or ../shared/tools/make-fixture)")
    return out


@pytest.fixture(scope="session")
def engine(checkpoint):
    from deepinfer import AsyncEngine, EngineArgs
    eng = AsyncEngine(EngineArgs.from_kwargs(str(checkpoint), max_model_len=1024, max_num_seqs=8))
    yield eng
    eng.shutdown()
