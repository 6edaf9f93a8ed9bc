"""False-pass and false-fail rates of the verdict over the generator family (crossalign.report.evidence).

Every pair is written as a MindFormers pynative log and a Megatron core 0.16.1 log, parsed and judged by
``build_summary`` (the path of ``crossalign compare``). Per family member and kind it prints how many pairs
passed, failed and were invalid (too little evidence: neither a pass nor a false fail), the false-pass
rate (``different`` pairs that passed) and the false-fail rate (``aligned`` pairs that failed), and the
margin: the largest co-movement of a different pair over the value its length needed.

    .venv/bin/python benchmarks/verdict_family.py [--pairs 300] [--first-seed 0]

``--pairs`` is per member and kind: 300 gives 2,100 different and 2,100 aligned pairs.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from crossalign.report.evidence import FAMILY, KINDS, judge, pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pairs", type=int, default=300, help="pairs per family member and kind")
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    totals = {kind: Counter() for kind in KINDS}
    print(f"{'member':18s} {'kind':9s} {'pairs':>5s} {'pass':>5s} {'fail':>5s} {'invalid':>7s} "
          f"{'false pass':>10s} {'false fail':>10s}  closest different pair (co-movement / needed)")
    for member in FAMILY:
        for kind in KINDS:
            verdicts, closest = Counter(), None
            for pair in pairs(member, kind, args.pairs, args.first_seed):
                summary = judge(pair)
                verdicts[summary.verdict] += 1
                lm = summary.series["lm_loss"]
                if kind == "different" and lm.comove is not None and lm.comove_min:
                    margin = (lm.comove, lm.comove_min, pair.seed)
                    if closest is None or margin[0] - margin[1] > closest[0] - closest[1]:
                        closest = margin
            totals[kind].update(verdicts)
            wrong = verdicts["pass"] if kind == "different" else verdicts["fail"]
            note = "" if closest is None else f"  {closest[0]:.3f} / {closest[1]:.3f} (seed {closest[2]})"
            print(f"{member.name:18s} {kind:9s} {args.pairs:5d} {verdicts['pass']:5d} {verdicts['fail']:5d} "
                  f"{verdicts['invalid']:7d} {wrong / args.pairs:10.4f} {'':10s}{note}" if kind == "different" else
                  f"{member.name:18s} {kind:9s} {args.pairs:5d} {verdicts['pass']:5d} {verdicts['fail']:5d} "
                  f"{verdicts['invalid']:7d} {'':10s} {wrong / args.pairs:10.4f}", flush=True)
    for kind in KINDS:
        total = sum(totals[kind].values())
        wrong = totals[kind]["pass"] if kind == "different" else totals[kind]["fail"]
        print(f"all {kind}: {total} pairs, {dict(totals[kind])}, "
              f"{'false pass' if kind == 'different' else 'false fail'} {wrong} ({wrong / total:.4%})")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
