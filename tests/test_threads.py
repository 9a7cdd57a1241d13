"""One thread rule for every entry point: `LLM()`, `eyas generate` and `eyas train` pick the same count for the same
model, and `--threads` / `threads=` override it."""

import json

import pytest
import torch

from eyas import LLM
from eyas.cli import main
from eyas.threads import SMALL_MODEL_PARAMS, configure_threads, default_num_threads


@pytest.fixture
def two_threads():
    """Start each test from torch's state after a user set 2 threads, and leave the suite's 1 thread after."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import make_served_checkpoint

    return make_served_checkpoint(tmp_path_factory.mktemp("threads"))


def test_the_rule():
    assert default_num_threads(SMALL_MODEL_PARAMS - 1, "cpu") == 1
    large = default_num_threads(SMALL_MODEL_PARAMS, "cpu")
    assert large == default_num_threads(10**12, "cpu") == default_num_threads(10**6, "cuda") >= 1
    with pytest.raises(ValueError, match="at least 1"):
        configure_threads(torch.nn.Linear(2, 2), 0)


def test_llm_default_is_what_the_cli_picks(target, two_threads, capsys):
    llm = LLM(target)
    assert llm.num_threads == torch.get_num_threads() == 1  # a small model on CPU
    torch.set_num_threads(2)
    assert main(["generate", "--model", str(target), "--prompt", "def f(x):", "--max-new-tokens", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_generated"] == 2
    assert torch.get_num_threads() == 1
    assert main(["generate", "--model", str(target), "--prompt", "x", "--max-new-tokens", "2", "--json",
                 "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert LLM(target, threads=2).num_threads == torch.get_num_threads() == 2


def test_train_uses_the_rule(target, two_threads, tmp_path):
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import train

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f_{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(4)))
    train(TrainConfig(target=str(target), out=str(tmp_path / "run"), data=str(data), aux_layer_ids=[1, 2, 3],
                      max_steps=1, batch_size=2, max_length=32))
    assert torch.get_num_threads() == 1
