"""The producer's peak RSS for a dataset's plan and its streamed read, against the dataset's size.

Each size runs in a fresh process: the plan's pass (``plan_dataset``: the read, the reservoir
sample counted with the demo tokenizer, the byte bound's suspects) and then the read the queue
window takes (``PromptStream`` to the end of the file, as a run that goes to its end reads it; the
messages Redis holds are bounded by the window, not by this). ``--dict`` puts back the reader's old
duplicate-id dict (id string -> line) for the figures before.

    .venv/bin/python -m bench.producer_memory 100000 400000 [--dict]   (from the repo's root)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_data(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            text = f"Prompt {i}: explain case {i % 977} of the quick brown fox over the lazy dog, step by step."
            fh.write(json.dumps({"id": f"m{i:07d}", "messages": [{"role": "user", "content": text}]}) + "\n")


def child(path: Path, old_dict: bool) -> None:
    import common.datasets as cd
    from common.config import load_config
    from common.prompt_tokens import load_tokenizer
    from producer.plan import plan_dataset
    from producer.window import PromptStream

    if old_dict:
        class DictIds:  # the reader before: every id string kept, ~120 B each
            def __init__(self) -> None:
                self.seen: dict[str, int] = {}

            def add(self, prompt_id: str) -> bool:
                if prompt_id in self.seen:
                    return False
                self.seen[prompt_id] = len(self.seen)
                return True
        cd.SeenIds = DictIds  # type: ignore[misc,assignment]
    cfg = load_config(path.parent / "fleet.toml")
    ds = cfg.datasets[0]
    tokenizer = load_tokenizer(str(cfg.model.tokenizer), trust_remote_code=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    plan = plan_dataset(cfg, ds, tokenizer, None)
    t1 = time.monotonic()
    stream = PromptStream(ds)
    while len(stream.take(2000)) == 2000:
        pass
    t2 = time.monotonic()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"prompts": plan.prompts, "read": stream.stats.prompts, "rss_before_mib": before / 1024,
                      "peak_rss_mib": peak / 1024, "plan_s": round(t1 - t0, 1), "read_s": round(t2 - t1, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int, default=[100_000, 400_000])
    ap.add_argument("--dict", action="store_true", help="the old duplicate-id dict, for the figures before")
    ap.add_argument("--child", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dict)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            data = folder / "data.jsonl"
            write_data(data, n)
            (folder / "fleet.toml").write_text(
                f'[model]\nname = "moonshotai/kimi-k2.5"\ntokenizer = "{REPO / "demo" / "tokenizer"}"\n'
                'trust_remote_code = false\ncontext_length = 131072\n\n'
                '[lengths.short]\nmax_tokens = 1024\ntimeout_s = 60\n\n'
                f'[output]\ndir = "{folder / "out"}"\n\n[[datasets]]\nname = "D"\npath = "{data}"\n'
                'length = "short"\nbudget_tokens = 1_000_000\n')
            cmd = [sys.executable, "-m", "bench.producer_memory", "--child", str(data),
                   *(["--dict"] if args.dict else [])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            result = json.loads(out)
            print(f"{n:>9,} prompts ({data.stat().st_size / 2**20:.0f} MiB): peak RSS {result['peak_rss_mib']:.1f} MiB "
                  f"(after imports {result['rss_before_mib']:.1f}), plan {result['plan_s']} s, "
                  f"read {result['read_s']} s{' [old dict]' if args.dict else ''}", flush=True)


if __name__ == "__main__":
    main()
