"""HF `generate` with a static KV cache and `torch.compile` (HF's own fast path, what a GPU user tries first),
as one arm of `benchmarks/decode.py`, run in its own process so the caller can bound its compile time.

Reads a JSON job on stdin ({"preset", "root", "device", "dtype", "batches": [[[ids...], ...], ...],
"max_new_tokens", "warmup": [[ids...]]}) and prints one JSON line: seconds, tokens, texts, compile_s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    job = json.loads(sys.stdin.read())
    from dvi.decode.kv import left_pad
    from dvi.models.loading import load_embedded_pair

    torch.set_num_threads(int(job.get("threads", 1)))
    pair = load_embedded_pair(job["preset"], job.get("root"), device=job["device"], dtype=job["dtype"])
    target = pair.target.eval()
    target.generation_config.cache_implementation = "static"
    target.forward = torch.compile(target.forward, mode="reduce-overhead", fullgraph=True)
    n = int(job["max_new_tokens"])
    kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)

    def run(batch):
        ids, valid = left_pad(batch, target.device)
        m = ids.shape[1]
        out = target.generate(ids, attention_mask=valid.long(), **kw)
        if out.device.type == "cuda":
            torch.cuda.synchronize()
        return out[:, m:].tolist()

    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in job["warmup"]:
            run(batch)
        compile_s = time.perf_counter() - t0
        seconds, tokens, texts = 0.0, 0, []
        for batch in job["batches"]:
            t = time.perf_counter()
            rows = run(batch)
            seconds += time.perf_counter() - t
            tokens += sum(len(r) for r in rows)
            texts += rows
    print(json.dumps({"seconds": seconds, "tokens": tokens, "texts": texts, "compile_s": compile_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
