"""The EAGLE head that truespec serves computes what the head trained with transformers' layers computed."""

from pathlib import Path

import torch
from transformers import AutoConfig

from helpers.models import transformers_in_float64
from truespec.forward_context import set_forward_context
from truespec.models.eagle import load_eagle_head, save_eagle_head
from truespec.models.loader import load_model
from truespec.training.eagle import EagleTrainHead, head_config
from truespec.worker.input_builder import ContextRow, build_forward_context


def test_served_head_equals_trained_head(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target_dir = tiny_models["hybrid"]
    config = head_config(AutoConfig.from_pretrained(target_dir), intermediate_size=40)
    torch.manual_seed(3)
    trained = EagleTrainHead(config).to(torch.float64)
    for name, p in trained.named_parameters():
        p.data.normal_(0, 0.3) if "norm" not in name else p.data.uniform_(0.8, 1.2)
    save_eagle_head(tmp_path / "eagle", config, trained.state_dict(), dtype=torch.float64)

    target = load_model(target_dir, "float64", "cpu").model
    served = load_eagle_head(tmp_path / "eagle", target, config.hidden_size)
    n = 23
    ids = torch.randint(1, 300, (n,))
    hidden = torch.randn(n, config.hidden_size, dtype=torch.float64)
    with torch.no_grad(), transformers_in_float64():  # transformers' float32 casts made float64: exact comparison
        expected = trained(target.embed_tokens(ids)[None], hidden[None], torch.arange(n)[None])[0]
    layer = served.layers[0].self_attn.attn
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 8), dtype=torch.float64)
    ctx = build_forward_context([ContextRow([0, 1, 2], 0, n, -1, -1, n - 1, 0)], 8, torch.device("cpu"))
    with torch.no_grad(), set_forward_context(ctx):
        got = served(ids, torch.arange(n), hidden)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
