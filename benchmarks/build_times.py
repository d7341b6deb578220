"""How long `pip install .` takes, as a new user runs it, and where the time goes: one fresh clone
into one fresh venv per run, timed from the pip command's start to its end, with the build's
per-target compile times read from ninja's log (the build directory kept through
scikit-build-core's `build-dir`). Writes a results file, so a change that doubles one target
shows in review (docs/install.md, "How long the build takes").

    python benchmarks/build_times.py                    # four runs: TF installed first or not, CUDA on or off
    python benchmarks/build_times.py --runs tf,cuda     # one: TF installed first, the CUDA toolkit used
    python benchmarks/build_times.py --out benchmarks/results/build-DATE.txt

A run named `tf` installs TensorFlow (`--tf`, default the newest supported) into the venv first and
times only `pip install .`; without `tf` the same command installs TensorFlow itself (twice: in
pip's isolated build environment, then as the dependency). `cuda` builds with the CUDA toolkit the
build finds (the default targets where no GPU is visible); without it CMAKE_ARGS=-DTFCLIP_CUDA=OFF
builds as on a machine without a toolkit. pip's download cache is used (no network time measured
beyond what pip fetches anyway). Needs: git, python3 with venv, a C++ compiler.
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "baseline")
    except OSError:
        pass
    return "?"


def ninja_targets(build_dir):
    """[(seconds, target)] from the build's .ninja_log (its last build), longest first; and the
    compile's wall span in seconds."""
    path = os.path.join(build_dir, ".ninja_log")
    if not os.path.exists(path):
        return [], None
    rows = []
    for line in open(path):
        if line.startswith("#"):
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) >= 4:
            rows.append((int(parts[0]), int(parts[1]), parts[3]))
    if not rows:
        return [], None
    span = (max(e for _, e, _ in rows) - min(s for s, _, _ in rows)) / 1000.0
    return sorted(((e - s) / 1000.0, t) for s, e, t in rows)[::-1], span


def one_run(name, source, tf_pin, keep):
    tf_first = "tf" in name.split(",")
    cuda = "cuda" in name.split(",")
    work = tempfile.mkdtemp(prefix="tfclip-build-")
    try:
        clone = os.path.join(work, "tfclip")
        subprocess.run(["git", "clone", "-q", source, clone], check=True)
        venv = os.path.join(work, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = [os.path.join(venv, "bin", "python"), "-m", "pip"]
        subprocess.run(pip + ["install", "-q", "--upgrade", "pip"], check=True)
        if tf_first:
            subprocess.run(pip + ["install", "-q", tf_pin], check=True)
        build_dir = os.path.join(work, "build")
        env = dict(os.environ)
        env.pop("CMAKE_ARGS", None)
        if not cuda:
            env["CMAKE_ARGS"] = "-DTFCLIP_CUDA=OFF"
        log_path = os.path.join(work, "pip.log")
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            rc = subprocess.run(pip + ["install", "-v", ".", "-C", f"build-dir={build_dir}"], cwd=clone, env=env,
                                stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - t0
        targets, span = ninja_targets(build_dir)
        if keep:
            shutil.copy(log_path, os.path.join(ROOT, f"build-times-{name.replace(',', '-')}.log"))
        return {"name": name, "rc": rc, "wall": wall, "targets": targets, "span": span,
                "cpu_seconds": sum(t for t, _ in targets)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="tf,cuda;tf;cuda;none",
                    help="runs separated by ';', each a comma list of tf (TensorFlow installed first) and cuda")
    ap.add_argument("--source", default=ROOT, help="what to clone (default: this checkout's committed HEAD)")
    ap.add_argument("--tf", default="tensorflow==2.21.*", help="the TensorFlow installed first in a `tf` run")
    ap.add_argument("--out", help="results file (default: print only)")
    ap.add_argument("--top", type=int, default=25, help="targets listed per run")
    ap.add_argument("--keep-logs", action="store_true", help="copy each run's pip log into the checkout")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "-C", args.source, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    lines = [f"# pip install . from a fresh clone ({head}) into a fresh venv, {datetime.date.today()}, "
             f"{os.cpu_count()} cores, {cpu_name()} ({cpu_flags()}), Python {platform.python_version()}",
             f"# python benchmarks/build_times.py --runs '{args.runs}'"]
    print("\n".join(lines), flush=True)
    for name in [r for r in args.runs.split(";") if r]:
        r = one_run(name, args.source, args.tf, args.keep_logs)
        desc = (("TF installed first" if "tf" in name else "TF installed by pip (build env + dependency)") + ", "
                + ("CUDA toolkit used" if "cuda" in name else "CMAKE_ARGS=-DTFCLIP_CUDA=OFF"))
        out = [f"## {desc}: {r['wall']:.0f} s ({r['wall'] / 60:.1f} min), rc {r['rc']}"]
        if r["span"] is not None:
            out.append(f"#   compile: {r['span']:.0f} s wall, {r['cpu_seconds']:.0f} s of targets "
                       f"({r['cpu_seconds'] / max(r['span'], 1e-9):.2f} busy cores); the rest: pip, TF installs, configure, wheel")
        for t, target in r["targets"][:args.top]:
            out.append(f"{t:8.1f} s  {target}")
        print("\n".join(out), flush=True)
        lines += out
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
