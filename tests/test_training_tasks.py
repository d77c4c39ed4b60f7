"""The training pipeline's edit-task format, its loss mask and its edit-point boosts (truespec.training)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR
from truespec.training.__main__ import parse_config
from truespec.training.data import BatchSampler, encode_with_boosts
from truespec.training.models import DRAFT_SIZES, TARGET_SIZES
from truespec.training.tasks import changed_spans
from truespec.training.tokenizer import format_edit
from truespec.training.train import EDIT_MARKER_IDS, edit_prompt_weights

EOT, ORIGINAL, INSTRUCTION, UPDATED = EDIT_MARKER_IDS


def test_edit_format_puts_the_instruction_first() -> None:
    assert format_edit("x = 1\n", "change the literal 1 to 2") == (
        "<|instruction|>change the literal 1 to 2<|original|>x = 1\n<|updated|>")
    assert format_edit("x = 1\n", "i", "x = 2\n").endswith("<|updated|>x = 2\n<|endoftext|>")


def test_edit_prompt_weights_mask_instruction_original_and_markers() -> None:
    # a row starting inside an updated part, then a whole task, then plain text; 9 = any other token
    ids = torch.tensor([[9, 9, UPDATED, 8, 8, EOT, INSTRUCTION, 7, 7, ORIGINAL, 9, 9, UPDATED, 8, 8, EOT, 9, 9]])
    expected = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert edit_prompt_weights(ids)[0].tolist() == expected
    # a row starting inside an instruction (next marker <|original|>) is prompt side up to <|updated|>
    ids = torch.tensor([[7, 7, ORIGINAL, 9, UPDATED, 8, EOT, INSTRUCTION, 7, ORIGINAL, 9, UPDATED, 8, EOT]])
    assert edit_prompt_weights(ids)[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    # no markers at all (plain files, chat rows): every token keeps its loss
    assert edit_prompt_weights(torch.tensor([[9, 10, 11]]))[0].tolist() == [1, 1, 1]


def test_edit_points_are_the_words_that_do_not_copy() -> None:
    original = "def f(data):\n    return data + 1\n"
    renamed = "def f(rows):\n    return rows + 1\n"
    assert [renamed[a:b] for a, b in changed_spans(original, renamed)] == ["rows)", "rows "]
    # a deletion: the word where copying resumes (the diff aligns it as deleting "\nb = 2")
    deleted = "a = 1\nc = 3\n"
    assert [deleted[a:b] for a, b in changed_spans("a = 1\nb = 2\nc = 3\n", deleted)] == ["\nc"]
    inserted = "def f(data):\n    data = list(data)\n    return data + 1\n"
    assert [inserted[a:b] for a, b in changed_spans(original, inserted)] == ["\n    data = list(data)\n    "]


def test_edit_point_boosts_follow_the_token_offsets() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    text = format_edit("x = data\n", "rename data to rows", "x = rows\n")
    start = text.index("<|updated|>") + len("<|updated|>") + len("x = ")
    ids, boosts = encode_with_boosts(tokenizer, [text], [[(start, start + 4)]], 4.0)
    pieces = [tokenizer.decode([i]) for i in ids[0]]
    boosted = "".join(p for p, b in zip(pieces, boosts[0], strict=True) if b == 4.0)
    assert boosted.strip() == "rows" and set(boosts[0]) == {1.0, 4.0}


def test_sampler_returns_the_boosts_of_its_windows() -> None:
    stream = torch.arange(100, dtype=torch.int32)
    sampler = BatchSampler({"edit": stream, "plain": stream.clone()}, {"edit": 0.5, "plain": 0.5}, 8, 16, 0,
                           {"edit": stream.to(torch.float16) * 2})
    ids, boosts = sampler.next_with_boosts()
    is_edit = boosts[:, 0] != 1  # window starts > 0 are never 0.5: edit rows have boost 2 * id
    assert is_edit.any() and (~is_edit).any()
    assert torch.equal(boosts[is_edit], 2 * ids[is_edit].float()) and (boosts[~is_edit] == 1).all()
    plain = BatchSampler({"plain": stream}, {"plain": 1.0}, 8, 4, 0)  # no boosts: nothing to multiply
    assert plain.next_with_boosts()[1] is None


def test_training_command_line_sets_the_model_sizes(tmp_path: Path) -> None:
    cfg = parse_config(["--out", str(tmp_path), "--target-layers", "8", "--target-intermediate-size", "512",
                        "--draft-intermediate-size", "384", "--edit-point-boost", "1"])  # the 48% model (MODEL.md)
    assert (cfg.target_sizes.num_layers, cfg.target_sizes.intermediate_size) == (8, 512)
    assert cfg.target_sizes.hidden_size == TARGET_SIZES.hidden_size and cfg.draft_sizes.intermediate_size == 384
    assert cfg.edit_point_boost == 1
    default = parse_config(["--out", str(tmp_path)])  # the shipped run
    assert (default.target_sizes, default.draft_sizes, default.edit_point_boost) == (TARGET_SIZES, DRAFT_SIZES, 2)
    with pytest.raises(SystemExit):
        parse_config(["--out", str(tmp_path), "--target-layers", "2"])


def test_default_training_sizes_are_the_shipped_models() -> None:
    """``python -m truespec.training`` with no size options reproduces the shapes of the shipped checkpoints."""
    target = json.loads((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
    draft = json.loads((Path(DEFAULT_DRAFT_MODEL_DIR) / "config.json").read_text())
    assert (target["num_hidden_layers"], target["intermediate_size"], target["hidden_size"]) == (
        TARGET_SIZES.num_layers, TARGET_SIZES.intermediate_size, TARGET_SIZES.hidden_size)
    assert (draft["num_hidden_layers"], draft["intermediate_size"], draft["hidden_size"]) == (
        DRAFT_SIZES.num_layers, DRAFT_SIZES.intermediate_size, DRAFT_SIZES.hidden_size)
