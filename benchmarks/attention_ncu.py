"""One decode attention call (or a packed store) of the Qwen3.5-0.8B attention shape, run a few times eagerly, to
be read under Nsight Compute: where a kernel's time goes (stall reasons, instruction mix, occupancy).

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section InstructionStats \\
        --kernel-name regex:_paged_attention_kernel --launch-skip 2 --launch-count 1 \\
        python3 benchmarks/attention_ncu.py --cache turboquant_4bit_nc --keys 32768 [--query-len 1] [--store]

``--cache auto``: the model-dtype (bf16) cache. ``--store``: also store ``--query-len`` rows into the packed
cache each time (kernels/kv_store_packed.py; packed caches only), into the cache's last slots (not the request's
last positions: its block table is a permutation; the timing does not care). The batch is packed_attention_speed.py's
(one request, random K/V).
"""

import argparse

import torch
from packed_attention_speed import BLOCK, HKV, D, batch

from truespec.kernels.kv_store_packed import store_packed
from truespec.kernels.paged_attention import paged_attention
from truespec.kernels.paged_attention_packed import paged_attention_packed
from truespec.kv_cache.formats import FORMATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default="turboquant_4bit_nc")
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--store", action="store_true")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    q, k, v, qsl, seq_lens, tables = (x.to("cuda") for x in batch(args.keys, args.query_len, 0.0, gen))
    q, meta = q.to(torch.bfloat16), (qsl, seq_lens, tables)
    if args.cache == "auto":
        if args.store:
            parser.error("--store needs a packed --cache")
        cache = torch.stack([k, v]).view(2, -1, BLOCK, HKV, D).to(torch.bfloat16)
        call = lambda: paged_attention(q, cache, *meta, D**-0.5)  # noqa: E731
    else:
        fmt = FORMATS[args.cache]
        cache = fmt.encode(k, v).view(-1, BLOCK, HKV, fmt.bytes_per_token(D))
        rows = k[-args.query_len:].to(torch.bfloat16), v[-args.query_len:].to(torch.bfloat16)
        slots = torch.arange(args.keys - args.query_len, args.keys, device="cuda")
        call = lambda: paged_attention_packed(q, cache, *meta, D**-0.5, fmt, D)  # noqa: E731
        if args.store:
            attend = call
            call = lambda: (store_packed(*rows, cache, slots, fmt), attend())  # noqa: E731
    for _ in range(args.repeat):
        call()
    torch.cuda.synchronize()
    print(f"{args.cache} keys {args.keys} rows {args.query_len}: {args.repeat} calls done")


if __name__ == "__main__":
    main()
