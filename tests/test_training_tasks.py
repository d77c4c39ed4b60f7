"""The training pipeline's edit-task format and its loss mask (truespec.training)."""

import torch

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
