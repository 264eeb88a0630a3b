"""One screen of what the GPU check showed: `summarize.py OUTDIR GPUS` (run by `run`).

Reads OUTDIR/steps.txt, env.json, every matrix-*/report.json and arbiter-*.csv. Exits 1 when a
report has a failed row or a run error, so `run` fails with it.
"""
import csv
import json
import os
import sys

out, gpus = sys.argv[1], int(sys.argv[2])
bad = False


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


env = load(os.path.join(out, "env.json")) or {}
gpu = env.get("gpu", {})
print("Lockstep GPU check")
print(f"  libtorch {env.get('libtorch_version', '?')}, CPU {env.get('cpu_capability', '?')}, "
      f"GPUs {gpus}: {', '.join(gpu.get('gpus', [])) or 'none'}")
print(f"  driver CUDA {gpu.get('driver_cuda', '?')}, runtime CUDA {gpu.get('cuda_runtime', '?')}, "
      f"cuDNN {gpu.get('cudnn', '?')}, NCCL {env.get('nccl', '?')}")
print()
print("steps (name, verdict, seconds, command):")
try:
    with open(os.path.join(out, "steps.txt")) as f:
        for line in f:
            print("  " + line.rstrip()[:150])
except OSError:
    print("  (none yet)")
if gpus == 0:
    print()
    print("no GPU here: the GPU steps refused before running anything (what CI checks):")
    for name in ("nccl", "cuda"):
        try:
            with open(os.path.join(out, "logs", name + ".log")) as f:
                reason = next((l.strip() for l in f if l.startswith("error:")), "(no reason printed)")
        except OSError:
            reason = "(no log)"
        print(f"  {name}: {reason[:160]}")
    print("the cuda-FAMILY steps ran on the CPU as a GPU host runs them (--device cpu "
          "--exec-ranks: the same configurations, launches and limits)")
print()
walls = {}
for name in sorted(os.listdir(out)):
    report = load(os.path.join(out, name, "report.json"))
    if not name.startswith("matrix-") or report is None:
        continue
    s = report["summary"]
    walls[name] = report.get("wall_time_seconds")
    rows = report["comparisons"]
    repeats = [r for r in rows if r["config"] == r["reference"]]
    repeat_ok = sum(r["passed"] for r in repeats)
    wall = walls[name]
    print(f"{name}: {s['comparisons']} rows, {s['passed']} passed, {s['failed']} failed, "
          f"{s['errors']} run errors; bitwise repeat rows {repeat_ok}/{len(repeats)}"
          + (f"; {wall:.1f} s" if wall else ""))
    for r in rows:
        if not r["passed"]:
            bad = True
            why = (r.get("first_failure") or {}) if isinstance(r.get("first_failure"), dict) else r.get("first_failure")
            print(f"  FAIL {r['model']} {r['config']} vs {r['reference']}: {str(why)[:110]}")
    for e in report.get("errors", [])[:10]:
        bad = True
        print(f"  ERROR {str(e)[:140]}")
    if s["failed"] or s["errors"]:
        bad = True
print()
for name in sorted(os.listdir(out)):
    if not (name.startswith("arbiter-") and name.endswith(".csv")):
        continue
    worst = {}
    with open(os.path.join(out, name)) as f:
        for row in csv.reader(f):
            try:
                d_run, d_ref = float(row[6]), float(row[7])
            except (IndexError, ValueError):
                continue
            if d_ref > 0:
                key = row[1].split("@")[0]
                worst[key] = max(worst.get(key, 0.0), d_run / d_ref)
    if worst:
        top = sorted(worst.items(), key=lambda kv: -kv[1])[:6]
        print(f"{name}: largest raw |run-fp64|/|fp32 ref-fp64| per configuration (K = 16 judges "
              f"with carried noise and a floor; docs/parity.md): "
              + ", ".join(f"{k} {v:.2f}" for k, v in top))
cpu, cuda = walls.get("matrix-cpu"), walls.get("matrix-cuda-tf32")
if cpu and cuda:
    print(f"wall time of the same world-2 rows: CPU {cpu:.1f} s, CUDA (tf32) {cuda:.1f} s")
sys.exit(1 if bad else 0)
