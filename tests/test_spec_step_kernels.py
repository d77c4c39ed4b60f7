"""kernels/spec_step.py against its torch references (ops/spec_step.py) on random ragged batches: the moved
positions, context lengths, state sources and KV slots of a step queued ahead (padding rows untouched, positions
past a request's blocks get slot -1), a greedy verify's accepted counts and next tokens, and a drafting chain's
metadata (padded request counts up to 64, k = 1 .. 8)."""

import random

import pytest
import torch

from helpers.kernels import DEVICE, gpu, needs_cuda
from truespec.kernels import (
    chain_metadata,
    chain_metadata_ref,
    greedy_accepted,
    greedy_accepted_ref,
    move_positions,
    move_positions_ref,
)
from truespec.ops.spec_step import ChainMetadata


def random_step(rng: random.Random, width: int, block_size: int, num_pad: int) -> dict:
    qsl, positions, tables, src = [0], [], [], []
    for r in range(rng.randint(1, 6)):
        query_len, start = rng.randint(1, 5), rng.randint(0, width * block_size - 3)
        qsl.append(qsl[-1] + query_len)
        positions += range(start, start + query_len)
        tables.append([rng.randrange(100) if c < rng.randint(1, width) else -1 for c in range(width)])
        src.append(-1 if rng.random() < 0.3 else 7 * r)
    num_reqs, num_tokens = len(src), len(positions)
    return {"positions": torch.tensor(positions + [0] * num_pad), "seq_lens": torch.randint(1, 50, (num_reqs,)),
            "state_src": torch.tensor(src), "slot_mapping": torch.full((num_tokens + num_pad,), -1),
            "block_tables": torch.tensor(tables), "query_start_loc": torch.tensor(qsl),
            "shift": torch.randint(0, 4, (num_reqs,)), "num_tokens": num_tokens, "block_size": block_size}


def check_move_positions(device: torch.device, trials: int) -> None:
    rng = random.Random(0)
    for _ in range(trials):
        step = random_step(rng, width=4, block_size=4, num_pad=3)
        tensors = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.items()}
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in step.items()}
        move_positions(**tensors)
        move_positions_ref(**expected)
        for name in ("positions", "seq_lens", "state_src", "slot_mapping"):
            assert torch.equal(tensors[name].cpu(), expected[name]), name
        assert (expected["slot_mapping"][step["num_tokens"]:] == -1).all()  # padding untouched


def check_greedy_accepted(device: torch.device, trials: int) -> None:
    rng = random.Random(1)
    for _ in range(trials):
        qsl, argmax, ids = [0], [], []
        for _ in range(rng.randint(1, 6)):
            d = rng.randint(0, 4)
            target = [rng.randrange(9) for _ in range(d + 1)]
            cut = rng.randint(0, d)
            ids += [rng.randrange(9)] + target[:cut] + [rng.randrange(9) for _ in range(d - cut)]
            argmax += target
            qsl.append(qsl[-1] + d + 1)
        max_drafts = max(b - a for a, b in zip(qsl, qsl[1:], strict=False)) - 1
        args = [torch.tensor(argmax), torch.tensor(ids), torch.tensor(qsl)]
        got = greedy_accepted(*(a.to(device) for a in args), max_drafts)
        assert [g.cpu().tolist() for g in got] == [e.tolist() for e in greedy_accepted_ref(*args, max_drafts)]


def random_chain_step(rng: random.Random, top: int, k: int, width: int, block_size: int) -> tuple[list, int]:
    """A verify of ``num_reqs`` requests (1 + 0..k rows each, drafts accepted up to a random point) in the chain's
    static buffers (rows past the step hold stale values), and the request count it is padded to."""
    q, num_reqs = 1 + k, rng.randint(1, top)
    size = rng.choice([s for s in (1, 2, 4, 8, 16, 32, top) if num_reqs <= s <= top])
    stale = [rng.randrange(50) for _ in range(3 * top * q)]
    argmax, ids, positions, qsl = stale[:top * q], stale[top * q:2 * top * q], stale[2 * top * q:], [0]
    for _ in range(num_reqs):
        d, row, start = rng.randint(0, k), qsl[-1], rng.randint(0, width * block_size - 1)
        target = [rng.randrange(9) for _ in range(d + 1)]
        cut = rng.randint(0, d)
        argmax[row:row + d + 1] = target
        ids[row:row + d + 1] = [rng.randrange(9)] + target[:cut] + [rng.randrange(9) for _ in range(d - cut)]
        positions[row:row + d + 1] = range(start, start + d + 1)
        qsl.append(row + d + 1)
    qsl += [rng.randrange(50) for _ in range(top - num_reqs)]  # stale query starts past the real ones
    tables = [[rng.randrange(100) if rng.random() < 0.8 else -1 for _ in range(width)] for _ in range(top)]
    tensors = [torch.tensor(argmax), torch.tensor(ids), torch.tensor(positions), torch.tensor(qsl),
               torch.tensor(tables), torch.tensor(num_reqs)]
    return tensors, size


def check_chain_metadata(device: torch.device, trials: int) -> None:
    rng = random.Random(2)
    for _ in range(trials):
        top, k, width, block_size = rng.choice([1, 3, 8, 16, 64]), rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 5), 4
        tensors, size = random_chain_step(rng, top, k, width, block_size)
        got, expected = ChainMetadata.empty(top, k, device), ChainMetadata.empty(top, k, torch.device("cpu"))
        chain_metadata(*(t.to(device) for t in tensors), size, k, block_size, got)
        chain_metadata_ref(*tensors, size, k, block_size, expected)
        for name, value in vars(expected).items():
            assert torch.equal(getattr(got, name).cpu(), value), (name, size, k)


def test_chain_metadata_matches_reference() -> None:
    check_chain_metadata(DEVICE, 60)


def test_move_positions_matches_reference() -> None:
    check_move_positions(DEVICE, 40)


def test_greedy_accepted_matches_reference() -> None:
    check_greedy_accepted(DEVICE, 60)


@gpu
@needs_cuda
@pytest.mark.parametrize("check", [check_move_positions, check_greedy_accepted, check_chain_metadata])
def test_spec_step_kernels_on_the_gpu(check: object) -> None:
    check(torch.device("cuda"), 300)
